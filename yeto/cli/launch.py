"""`yeto launch`: a syncer and its islands as local processes, with one live display.

For a one-machine run or a simulation of a fleet:

    yeto launch --islands torch,torch,mlx --model runs/demo/model \\
        --data runs/demo/data/train.jsonl --eval-data runs/demo/data/eval.jsonl \\
        --max-steps 200 --sync-every 20

Flags the launcher does not know go to every island unchanged (see
``python -m yeto.learner --help``); ``--torch-args`` / ``--mlx-args`` go to one
kind only. Outputs, in --out:

  syncer/            the syncer's state, tape.jsonl, log.txt, final/ (its adapter)
  islands/<id>/      each island's adapter/, metrics.jsonl, summary.json, log.txt
  adapter/           a copy of syncer/final/ (peft; `yeto export` converts it)
  summary.json       held-out loss before/after, rounds, bytes up/down, seconds
  tensorboard/       with --report-to tensorboard

The display shows per island its step, training and held-out loss, loss tokens
per second, the round (version) it holds and its state, read from the islands'
``metrics.jsonl`` files and the syncer's Status. Ctrl-C stops the run cleanly:
every island gets SIGINT, ends its step, pushes its last work and waits for the
final weights, the syncer finishes the run and writes ``final/``, and every
island saves its adapter. A second Ctrl-C stops at once (no outputs saved by
islands still running); the launcher escalates by itself after --stop-timeout.

Islands are the ordinary island programs (``python -m yeto.learner``,
``python -m yeto.mlx.learner``), which stop this way on their own: the first
SIGINT/SIGTERM ends training after the current step, then the island pushes its
last work, waits for the final weights and saves; a second one stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import time
from functools import partial
from pathlib import Path

from syncer.run import Config
from yeto import net, runfile
from yeto.backends import BACKENDS
from yeto.cli import join
from yeto.cli.launch_view import Display
from yeto.cli.local_run import LaunchConfig, LaunchError, LocalRun
from yeto.cli.progress import IslandProc
from yeto.config import IslandConfig, island_parser
from yeto.metrics import MetricsError, check_report_to
from yeto.signals import GracefulStop

log = logging.getLogger("yeto.cli.launch")

# island flags the launcher sets itself
OWN_ISLAND_FLAGS = ("--syncer", "--learner-id", "--learner-index", "--num-learners", "--output",
                    "--model", "--data", "--eval-data", "--token", "--tls-ca", "--tls-cert",
                    "--tls-key")
# launch flags passed on to the syncer: launch flag -> (syncer flag, type, what it does);
# unset, the syncer's own default (syncer.run.Config) holds
SYNCER_FLAGS = {
    "outer": ("--outer", str, "the outer rule: auto | nesterov | nesterov-warmup | ..."),
    "outer_lr": ("--outer-lr", float, "outer Nesterov learning rate"),
    "outer_momentum": ("--outer-momentum", float, "outer momentum"),
    "merge": ("--merge", str, "mean | uniform | rda"),
    "rounds": ("--rounds", int, "rounds to run (0: until the islands finish)"),
    "grace": ("--grace", str, "auto | fixed"),
    "grace_ms": ("--grace-ms", int, "straggler grace after the quorum's pushes"),
    "round_timeout_s": ("--round-timeout-s", float, "commit a round after this long"),
    "downlink": ("--downlink", str, "encoding of broadcasts: f32 | bf16 | q4"),
    "fragments": ("--fragments", int, "cut the weights into P fragments synced in turn"),
    "quorum": ("--quorum", int, "pushes that commit a round"),
}
# exit codes of an island stopped by the launcher's signals: 130 (it caught the
# interrupt), or killed by SIGINT (an interrupt it did not catch), SIGTERM, SIGKILL
STOPPED_CODES = (130, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL)
STATUS_EVERY_S = 1.0   # the syncer's Status, for the display
TICK_S = 0.25          # how often the launcher looks at its processes and files


# ---- the whole run ---------------------------------------------------------------------
def run_local(cfg: LaunchConfig, display: Display | None = None,
              on_started=None) -> tuple[int, LocalRun, dict | None]:
    """Start, follow and stop a local run. Returns (exit code, the run, summary).
    Exit code: 0 when every island finished with the final weights, 130 when
    stopped by a signal (outputs saved), 1 when an island or the syncer failed."""
    display = display or Display(cfg.display, status_every_s=cfg.status_every_s)
    run = LocalRun(cfg)
    run.prepare()
    t0 = time.monotonic()
    on_signal = partial(_on_signal, run)
    try:
        with GracefulStop(on_first=on_signal, on_second=on_signal):
            _start(run, display, on_started)
            _follow(run, display)
            code = _finish(run, display)
    except BaseException:
        run.kill_all()
        display.final(None)
        raise
    finally:
        run.close()
    summary = run.collect(time.monotonic() - t0)
    display.final(run)
    return code, run, summary


def _on_signal(run: LocalRun, name: str) -> None:
    """SIGINT/SIGTERM to the launcher: the first stops the islands cleanly, the second
    at once."""
    run.request_stop(f"signal {name}")
    print(f"\n{name}: stopping at once" if run.hard_stop else
          f"\n{name}: stopping the islands; they finish their step, push, and save "
          "(again to stop at once)", file=sys.stderr, flush=True)


def _start(run: LocalRun, display: Display, on_started) -> None:
    run.start_syncer()
    display.say(f"syncer on {run.address}"
                + (f", dashboard {run.dashboard_url}" if run.dashboard_url else "")
                + f"; starting {len(run.cfg.backends)} islands ({', '.join(run.cfg.backends)})")
    if run.cfg.external:
        _say_external(run, display)
    run.start_islands()
    if run.cfg.external:
        display.show(run)  # the reserved slots, waiting
    if on_started is not None:
        on_started(run)


def _say_external(run: LocalRun, display: Display) -> None:
    """The join command of every reserved slot (never the token itself)."""
    lines = run.reserve_external()
    n = len(run.cfg.external)
    display.say(f"{n} external island slot{'s' if n > 1 else ''} reserved; the run starts "
                f"when {'they join' if n > 1 else 'it joins'} (other machines dial "
                f"{run.join_address}; also in {run.out / 'join.txt'}):\n")
    for line in lines:
        display.say(line)
    if run.token_file is not None:
        display.say(f"no --token given: generated one in {run.token_file} (readable by you "
                    "only); give it to the other machines over a channel you trust")


def _follow(run: LocalRun, display: Display) -> None:
    """Until every island exited: read metrics and the tape, show them, react to
    failures, escalate a stop that takes too long."""
    last_status = 0.0
    while run.running() or run.awaiting_external():
        now = time.monotonic()
        with_status = now - last_status >= STATUS_EVERY_S
        if with_status:
            last_status = now
        new, exited = run.poll(with_status=with_status)
        display.update(run, new, exited)
        _on_failures(run, display, exited)
        run.escalate()
        time.sleep(TICK_S)


def _on_failures(run: LocalRun, display: Display, exited: list[IslandProc]) -> None:
    """A failed island stops the others (unless --keep-going); a failed syncer stops all."""
    failed = [i for i in exited if i.code not in (0, None)
              and not (run.stopped_by_signal() and i.code in STOPPED_CODES)]
    for isl in failed:
        display.say(f"error: {isl.id} exited with code {isl.code}; the end of "
                    f"{isl.dir / 'log.txt'}:\n{tail(isl.dir / 'log.txt')}")
    if failed and not run.cfg.keep_going and run.stopping is None and run.running():
        display.say("stopping the other islands (--keep-going keeps them training)")
        run.request_stop(f"{failed[0].id} failed")
    failed_syncer = run.failed_syncer()
    if failed_syncer is not None and run.stopping is None:
        # (code 0: the run finished and the final weights went out; the islands are
        # saving their outputs and exit by themselves)
        code, log = failed_syncer
        display.say(f"error: the syncer exited with code {code}:\n" + tail(log))
        run.request_stop("the syncer failed")


def _finish(run: LocalRun, display: Display) -> int:
    """Every island exited: let the syncer end, read the last records, and say how the
    run ended (0 finished, 130 stopped by a signal, 1 failed)."""
    by_signal = run.stopped_by_signal()
    stopped = STOPPED_CODES if by_signal else ()
    failed = [i for i in run.islands if i.code != 0 and i.code not in stopped
              and not i.external]
    # external islands may train on after a stop: the syncer saves its state and goes
    code = run.stop_syncer(wait_s=1.0 if failed or (by_signal and run.external()) else 60.0)
    for isl in run.external():  # a syncer that ended by itself finished the run
        if isl.syncer_state and code == 0 and not by_signal:
            isl.syncer_state = "finished"
    new, exited = run.poll(with_status=False)
    display.update(run, new, exited)
    return 1 if failed else 130 if by_signal else 0


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join("    " + line for line in text[-lines:])


# ---- CLI -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto launch", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a syncer and islands as local processes (one machine, or a "
                    "simulation of a fleet) with a live display; Ctrl-C stops everything "
                    "cleanly with outputs saved.\n\nFlags not listed here go to every island "
                    "(python -m yeto.learner --help lists them), e.g. --max-steps 200 "
                    "--sync-every 20 --lora-r 8.",
        epilog="Example:\n  yeto launch --islands torch,torch,mlx --model runs/demo/model "
               "--data runs/demo/data/train.jsonl \\\n      --eval-data runs/demo/data/eval.jsonl "
               "--max-steps 200 --sync-every 20")
    p.add_argument("--islands", default="torch,torch",
                   help="comma list of island backends, one island each: torch, mlx "
                        "(default: torch,torch); 'none' with --external-islands: only the "
                        "syncer runs here")
    p.add_argument("--model", help="local Hugging Face model dir or hub id (required)")
    p.add_argument("--data", help="training data, sharded over the islands (required)")
    p.add_argument("--eval-data", default=None, help="held-out data, evaluated at every sync")
    p.add_argument("--out", type=Path, default=Path("runs/launch"),
                   help="output folder (default: runs/launch)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier run in --out")
    p.add_argument("--torch-args", default="", help="extra flags for torch islands only")
    p.add_argument("--mlx-args", default="", help="extra flags for MLX islands only")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the syncer listens on (default: loopback); 0.0.0.0 for all "
                        "interfaces")
    p.add_argument("--port", type=net.port, default=None,
                   help=f"syncer port (default: any free port; {net.DEFAULT_PORT} with "
                        "--external-islands, so a firewall can be opened for it)")
    p.add_argument("--token", default=None,
                   help="shared token for the syncer and islands (default: $YETO_TOKEN; "
                        "with --external-islands and none given, one is generated into "
                        "OUT/token)")
    _add_external_args(p)
    p.add_argument("--dashboard-port", type=net.port, default=0,
                   help="the syncer's dashboard port (default 0: any free port)")
    p.add_argument("--no-dashboard", action="store_true", help="no dashboard")
    p.add_argument("--syncer-args", default="", help="extra flags for the syncer "
                                                     "(python -m syncer --help)")
    p.add_argument("--shards", type=int, default=1, metavar="S",
                   help="serve the run by S syncer shards (python -m syncer --shard I/S), "
                        "each owning some of the fragments (--fragments defaults to S); "
                        "islands push each fragment to its owner. Shard 0 is in OUT/syncer, "
                        "shard i in OUT/syncer-i; OUT/adapter is assembled from all of them")
    for name, (flag, typ, text) in SYNCER_FLAGS.items():
        default = "every island" if name == "quorum" else getattr(Config, name)
        p.add_argument(flag, dest=name, type=typ, default=None,
                       help=f"{text} (the syncer's default: {default})")
    p.add_argument("--display", choices=("auto", "live", "plain", "none"), default="auto",
                   help="live: a table redrawn in place; plain: a line per round (default: "
                        "live on a terminal)")
    p.add_argument("--report-to", default="",
                   help="also write metrics to: tensorboard (in OUT/tensorboard; needs the "
                        "tensorboard package). JSONL metrics are always written")
    p.add_argument("--stop-timeout", type=float, default=120.0,
                   help="seconds islands get to finish and save after Ctrl-C before they are "
                        "interrupted")
    p.add_argument("--keep-going", action="store_true",
                   help="keep the other islands training when one fails")
    runfile.add_config_arg(p)
    return p


def _add_external_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--external-islands", "--external", "--external-learners", dest="external",
                   default="", metavar="SLOTS",
                   help="reserve slots for islands on other machines, which the launcher does "
                        "not start: N (torch or MLX), torch:N, mlx:N or a comma list. They "
                        "count in the quorum and the data sharding; the launcher prints the "
                        "command that joins each one and waits for them")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="the address other machines dial (default: --host when it is a "
                        "specific address; for 0.0.0.0, this machine's default-route address, "
                        "else its first non-loopback interface address)")
    p.add_argument("--tls-cert", type=Path, default=None,
                   help="PEM certificate of the syncer (TLS on); its names must include the "
                        "address islands dial")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA islands trust (default: --tls-cert, for a self-signed one)")


def _backends(p: argparse.ArgumentParser, args) -> tuple[list[str], list[str]]:
    """(local island backends, external slots) from --islands and --external-islands."""
    try:
        external = join.parse_slots(args.external)
    except join.JoinError as e:
        p.error(str(e))
    spec = "" if args.islands.strip() == "none" else args.islands
    backends = [b.strip() for b in spec.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not (backends or external):
        p.error(f"--islands {args.islands!r}: use a comma list of {', '.join(BACKENDS)}, "
                "e.g. --islands torch,torch,mlx ('none' only with --external-islands)")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together, e.g. --tls-cert server.pem "
                "--tls-key server.key")
    try:  # checked before anything starts: gRPC would fail only at the first handshake
        for f, flag in ((args.tls_cert, "--tls-cert"), (args.tls_key, "--tls-key"),
                        (args.tls_ca, "--tls-ca")):
            if f is not None:
                net.read_pem(f, flag)
    except net.TLSFileError as e:
        p.error(str(e))
    return backends, external


def config_from_args(p: argparse.ArgumentParser, args, rest: list[str]) -> LaunchConfig:
    backends, external = _backends(p, args)
    if not args.model or not args.data:
        p.error("--model and --data are required, e.g. yeto launch --model runs/demo/model "
                "--data runs/demo/data/train.jsonl (`yeto make-tiny-model DIR` and `yeto "
                "make-task DIR` build small local ones)")
    taken = [a for a in rest if a.split("=")[0] in OWN_ISLAND_FLAGS]
    if taken:
        p.error(f"{', '.join(taken)}: the launcher sets these for every island itself")
    if "mlx" in backends:
        from yeto.mlx import INSTALL_HINT, mlx_available

        if not mlx_available():
            p.error(f"--islands {args.islands}: {INSTALL_HINT}")
    try:
        report_to = check_report_to(args.report_to)
    except MetricsError as e:
        p.error(str(e))
    syncer_args = shlex.split(args.syncer_args)
    for name, (flag, _, _) in SYNCER_FLAGS.items():
        value = getattr(args, name)
        if value is not None and name != "quorum":
            syncer_args += [flag, str(value)]
    syncer_args += _shard_flags(p, args, external)
    shared = []
    if args.config is not None:  # the syncer and every island read the same file
        shared = ["--config", str(args.config.resolve())]
        syncer_args = shared + syncer_args
    return LaunchConfig(
        out=args.out, backends=backends, model=args.model, data=args.data,
        eval_data=args.eval_data, island_args=shared + rest,
        backend_args={"torch": shlex.split(args.torch_args), "mlx": shlex.split(args.mlx_args)},
        syncer_args=syncer_args, quorum=args.quorum, host=args.host,
        port=args.port if args.port is not None else net.DEFAULT_PORT if external else 0,
        external=external, advertise_host=args.advertise_host, tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_ca=args.tls_ca,
        token=args.token or os.environ.get("YETO_TOKEN") or None,
        dashboard_port=None if args.no_dashboard else args.dashboard_port,
        display=args.display, report_to=report_to, stop_timeout_s=args.stop_timeout,
        keep_going=args.keep_going, max_steps=_max_steps(rest, args.config),
        overwrite=args.overwrite, shards=args.shards)


def _shard_flags(p: argparse.ArgumentParser, args, external: list[str]) -> list[str]:
    """The syncer flags --shards adds (--fragments S unless given); refuses what a
    sharded local run does not do yet."""
    if args.shards < 1:
        p.error(f"--shards {args.shards}: give at least 1")
    if args.shards == 1:
        return []
    if external or args.tls_cert:
        p.error("--shards with --external-islands or --tls-cert: not yet; start the shards "
                "by hand (docs/how-to/a-run-too-big-for-one-syncer.md)")
    if args.fragments is None:
        return ["--fragments", str(args.shards)]
    if args.fragments < args.shards:
        p.error(f"--shards {args.shards} needs --fragments >= {args.shards} (each shard owns "
                f"at least one), got {args.fragments}")
    return []


def _max_steps(rest: list[str], config: Path | None) -> int:
    """The islands' --max-steps (flag, else run file, else the islands' default), for
    the display."""
    steps = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    steps.add_argument("--max-steps", type=int, default=None)
    known, _ = steps.parse_known_args(rest)
    if known.max_steps is None and config is not None:
        data = runfile.load(config)
        for section in ("island", "run"):
            known.max_steps = known.max_steps or data.get(section, {}).get("max_steps")
    return int(known.max_steps or IslandConfig.max_steps)


def print_outputs(run: LocalRun, summary: dict | None, code: int, stream=None) -> None:
    stream = stream or sys.stdout
    out = run.out
    if summary and summary.get("eval_loss_before") is not None and \
            summary.get("eval_loss_after") is not None:
        print(f"\nheld-out loss: {summary['eval_loss_before']:.4f} -> "
              f"{summary['eval_loss_after']:.4f}  ({summary['rounds']} rounds, "
              f"{summary['bytes_up'] / 1e6:.2f} MB up, {summary['bytes_down'] / 1e6:.2f} MB "
              f"down, {summary['seconds']:.0f} s)", file=stream)
    elif summary:
        print(f"\n{summary['rounds']} rounds, {summary['bytes_up'] / 1e6:.2f} MB up, "
              f"{summary['bytes_down'] / 1e6:.2f} MB down, {summary['seconds']:.0f} s",
              file=stream)
    print(f"outputs in {out}:", file=stream)
    states = " ".join(f"--state-dir {run.shard_dir(i)}" for i in range(run.cfg.shards))
    if (out / "adapter").is_dir():
        print(f"  adapter/         the final adapter (peft; `yeto export {states} --format mlx "
              "--out DIR` for mlx-lm)", file=stream)
    else:
        print(f"  (no final adapter: the run did not finish; `yeto export {states} ...` "
              "exports its last merged weights)", file=stream)
    if run.cfg.backends:
        print("  islands/<id>/    adapter/, metrics.jsonl, summary.json, log.txt", file=stream)
    if run.external():
        print(f"  join.txt         the join commands (external islands, "
              f"{', '.join(i.id for i in run.external())}, keep their outputs on their own "
              "machines: --output there)", file=stream)
    if run.cfg.shards > 1:
        print(f"  syncer/, syncer-1/ ... syncer-{run.cfg.shards - 1}/  each shard's tape.jsonl "
              "(one line per merge of its fragments), state, log.txt", file=stream)
    else:
        print("  syncer/          tape.jsonl (one line per merge), state, log.txt", file=stream)
    if (out / "summary.json").exists():
        print("  summary.json", file=stream)
    if (out / "tensorboard").is_dir():
        print(f"  tensorboard/     tensorboard --logdir {out / 'tensorboard'}", file=stream)
    if code == 130:
        print("stopped early by a signal; outputs above are as of the stop", file=stream)
    stream.flush()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args, rest = runfile.parse(p, argv, "launch", known=True,
                               programs={"island": island_parser})
    cfg = config_from_args(p, args, rest)
    logging.basicConfig(level="WARNING", format="%(message)s")
    try:
        code, run, summary = run_local(cfg)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_outputs(run, summary, code)
    if code == 1:
        print(f"error: a process failed; see {run.out}/islands/<id>/log.txt and "
              f"{run.out}/syncer/log.txt", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
