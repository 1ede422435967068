"""The end of a run: once no island trains and one has finished, the open rounds
commit, the final weights go out in f32 and `state-dir/final/` is written. Callers
hold the run's lock."""

from __future__ import annotations

import logging

from syncer import commit, persist

log = logging.getLogger("syncer")


def maybe_finish(run) -> None:
    """Finish the run once no island trains and one has finished (committing what
    the open rounds hold first); everyone vanished: keep Θ, wait for them."""
    if run.finished or not run.started or run.members.live() or run.closing:
        return
    if not run.members.in_state("finished"):
        return
    for rnd in list(run.open.values()):
        if rnd.responders and not run.finished and run.pending is None:
            commit.commit(run, rnd, "finish", run.clock())
    if not run.finished and run.pending is None and not run.fatal:
        final_broadcasts(run)
        finish(run)


def final_broadcasts(run) -> None:
    """Every fragment's final weights, exact, in f32."""
    for f in range(run.cfg.fragments):
        run.announce(run.downlink.next(run.theta, f, *run.span(f), final=True,
                                       version=run.fragment_version(f)))


def finish(run) -> None:
    """The run is over: final/ is written (a failure to write it fails the run)."""
    run.finished = True
    run.cond.notify_all()
    if run.cfg.state_dir is not None:
        try:
            persist.write_final(run)
        except OSError as e:
            run.fail(f"cannot write the final weights to {run.cfg.state_dir}: {e}. "
                     f"The state holds them (version {run.version}): free space and "
                     "restart the syncer with --resume")
            return
        except Exception as e:  # noqa: BLE001 - what an island sent cannot make final/
            run.fail(f"cannot build the final weights from what the islands sent ({e!r}); "
                     f"the state holds Θ at version {run.version}: `yeto export` writes "
                     "it in another format")
            return
    log.info("run finished at version %d", run.version)
