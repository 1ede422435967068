"""python -m syncer: run the outer loop of a DiLoCo run.

Example (two islands, 10 rounds, state and tape in runs/syncer):
    python -m syncer --quorum 2 --rounds 10 --state-dir runs/syncer
then start islands with `python -m yeto.learner --syncer 127.0.0.1:29400 ...`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from syncer.admission import Streams
from syncer.bounds import Bounds
from syncer.flags import add_round_args, round_config
from syncer.run import Config, Run
from syncer.service import EXCLUSIVE_PORT, SPILL_MIN_BYTES, SyncerServer, TLSFiles, listen, serve
from syncer.shards import Shard
from syncer.standby import peer_tls
from syncer.state import StateError
from yeto import memory, net, runfile
from yeto.codec import kernels
from yeto.config import island_parser
from yeto.io import atomic_write, host_port
from yeto.signals import GracefulStop, die_with_threads, ignore_signals

if TYPE_CHECKING:
    from syncer.dashboard import DashboardServer

log = logging.getLogger("syncer")
FINAL_DRAIN_S = 30.0  # how long a finished run waits for islands to take the final weights
STANDBY_TELL_S = 5.0  # and then for its standbys to hear it finished (they ask every second)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m syncer",
        description="The yeto syncer: waits for a quorum of islands, merges their "
                    "pseudo-gradients (weighted by loss tokens), applies an outer Nesterov "
                    "step and broadcasts the result.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example: python -m syncer --quorum 2 --rounds 10 --state-dir runs/syncer\n"
               "The tape (state-dir/tape.jsonl) holds one JSON line per merge.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; beyond loopback a token or TLS is required")
    p.add_argument("--port", type=net.port, default=net.DEFAULT_PORT,
                   help="port (0 = any free port)")
    p.add_argument("--direct-port", type=net.port, default=0, metavar="PORT",
                   help="where islands read their broadcasts as plain TCP sent from Θ's "
                        "memory (the direct downlink: the same bytes and checks as gRPC, "
                        "less of the syncer's CPU); 0 = any free port, named in each join "
                        "reply. An island that cannot reach it falls back to gRPC. Off "
                        "under TLS")
    p.add_argument("--no-direct", action="store_true",
                   help="no direct port: every broadcast over gRPC")
    p.add_argument("--quorum", type=int, default=Config.quorum, metavar="K",
                   help="islands that must join before round 1, and pushes that commit a round")
    p.add_argument("--rounds", type=int, default=Config.rounds, metavar="N",
                   help="rounds to run; 0 = until every island has finished")
    add_round_args(p)
    p.add_argument("--expect-islands", default="", metavar="ID,ID",
                   help="learner ids of islands started elsewhere (yeto launch --external-"
                        "islands): status and dashboard list them as reserved until they join")
    p.add_argument("--max-inflight-pushes", type=int, default=4,
                   help="pushes received at once; more wait (gRPC flow control holds them "
                        "back). A push under --spill-min-mib is held in memory as it came "
                        "until validated whole and merged; a larger one in a temporary file")
    p.add_argument("--spill-min-mib", type=float, default=SPILL_MIN_BYTES / 2**20,
                   help="pushes of this many MiB or more are received into an unlinked "
                        "temporary file in --state-dir (else the system's temp folder; at "
                        "most --max-inflight-pushes files, each rewritten by later pushes) "
                        "and merged from it chunk by chunk, so the syncer's memory is Θ and the "
                        "round's sum (8 B per parameter; 12 with momentum) whatever the "
                        "number of islands; 0 spills every push")
    add_trust_args(p)
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where state (state.safetensors, saved after every round), the tape "
                        "(tape.jsonl) and final weights (final/) are written")
    p.add_argument("--resume", action="store_true",
                   help="continue the run saved in --state-dir")
    p.add_argument("--trust-unkeyed-state", action="store_true",
                   help="with --resume and a --token: continue a state saved without a "
                        "secret (by a run without --token, or by a yeto older than keyed "
                        "states) once, vouching that nobody else could write its folder; "
                        "it is saved under the secret from its next round on")
    p.add_argument("--shard", default="0/1", metavar="I/S",
                   help="serve shard I of S: the rounds of the fragments dealt to it (by "
                        "parameter count; needs --fragments >= S); islands list every "
                        "shard's address in order, separated by ';' (--syncer 'A;B')")
    p.add_argument("--standby-of", default=None, metavar="HOST:PORT",
                   help="run as the standby of the primary syncer at HOST:PORT: receive each "
                        "state it commits (into --state-dir) and take the run over, serving "
                        "it on --port, once the primary has not answered for "
                        "--takeover-after-s; islands list both: --syncer PRIMARY,STANDBY")
    p.add_argument("--takeover-after-s", type=float, default=10.0,
                   help="a standby takes over after the primary has been silent this long")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="where the primary reaches this standby (default: --host and the "
                        "bound port; needed when --host is 0.0.0.0)")
    p.add_argument("--token", default=None,
                   help=f"shared secret islands must send (default: ${net.TOKEN_ENV})")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM server certificate")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM server private key")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA bundle: require client certificates signed by it (mutual "
                        "TLS). Without a token each certificate is its island's credential: "
                        "it must name the island's learner id as its CN or a subjectAltName")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback with neither token nor TLS")
    p.add_argument("--port-file", type=Path, default=None,
                   help="write the bound port here once listening (for scripts using --port 0)")
    p.add_argument("--dashboard-port", type=net.port, default=None, metavar="PORT",
                   help="serve the live dashboard (HTML + JSON API) on this port (0 = any free "
                        "port); off by default")
    p.add_argument("--dashboard-host", default="127.0.0.1",
                   help="address the dashboard listens on; beyond loopback the token is "
                        "required on every request (open http://HOST:PORT/?token=TOKEN)")
    p.add_argument("--dashboard-port-file", type=Path, default=None,
                   help="write the dashboard's bound port here once it listens")
    p.add_argument("--dashboard-shards", default=None, metavar="'A;B;...'",
                   help="a sharded run: every shard's address, in order (the islands' "
                        "--syncer list; standbys after commas are skipped; this syncer's own "
                        "entry may be 'self'): this dashboard then shows each shard's version, "
                        "rounds and bytes, and every island over all of them (asked with the "
                        "run's token)")
    p.add_argument("--log-level", default="INFO")
    runfile.add_config_arg(p)
    return p


def add_trust_args(p: argparse.ArgumentParser) -> None:
    """What one island may do, and how long a silent peer may hold on (syncer.bounds,
    syncer.admission); README, Faults."""
    b, g = Bounds(), p.add_argument_group("trust bounds (README, Faults)")
    g.add_argument("--max-delta", type=float, default=b.max_delta,
                   help="every pushed value must decode to at most this magnitude (a q4 block "
                        "scale to 1/7 of it): the round's sum can then never overflow")
    g.add_argument("--norm-factor", type=float, default=b.norm_factor,
                   help="a push longer than this multiple of the other islands' typical "
                        "push norm on its fragment (before any other island has pushed: of "
                        "the seed's norm there) is scaled down to it before it is summed; "
                        "an island's own pushes never raise its own bound (0 = off)")
    g.add_argument("--center-factor", type=float, default=b.center_factor,
                   help="in a round of 3 or more islands, a push farther from the round's "
                        "coordinate-wise median than this multiple of the other islands' "
                        "typical distance from it is pulled toward the median to that "
                        "distance (its weight kept): a minority cannot drag Θ away round "
                        "after round (0 = off)")
    g.add_argument("--max-tokens-per-step", type=int, default=b.max_tokens_per_step,
                   help="the most loss tokens per step a push may claim, whatever the "
                        "island declared when it joined (its batch x sequence length)")
    g.add_argument("--max-steps-per-push", type=int, default=b.max_steps_per_push,
                   help="the most optimizer steps one push may claim (an island that "
                        "declared its --sync-every H when it joined: also at most H x (2 + "
                        "the rounds it missed))")
    g.add_argument("--max-steps-per-second", type=float, default=b.max_steps_per_second,
                   metavar="R",
                   help="the fastest any island of this fleet trains, in optimizer steps per "
                        "second: a push may claim at most R x the seconds since that "
                        "island's last accepted push (plus one second's and 2 x its H), so "
                        "an island with no declared --sync-every cannot claim steps it had "
                        "no time for (0 = off; set it a few times above your fastest "
                        "island's steps per second)")
    g.add_argument("--max-share", type=float, default=b.max_share,
                   help="the most of a round's merge one island's pushes may hold (its "
                        "weight lowered to fit, its direction kept); 0 = auto: 2/k for k "
                        "islands in the round, so no cap for one or two")
    g.add_argument("--seed-from", default="", metavar="LEARNER_ID",
                   help="the island whose initial weights seed Θ (default: the first "
                        "island to join, unless more than half of the first quorum declared "
                        "other initial weights: then the earliest of those)")
    g.add_argument("--max-params", type=int, default=b.max_params,
                   help="the most values the first island's layout may hold")
    g.add_argument("--max-streams", type=int, default=128,
                   help="streaming calls (pushes, broadcast streams) served at once; 4 at "
                        "most per island; more are refused and retried")
    g.add_argument("--stream-idle-s", type=float, default=60.0,
                   help="a push that moves less than 64 KiB of payload in this long (a "
                        "smaller push: that arrives whole in it) is cancelled")
    g.add_argument("--save-timeout-s", type=float, default=Config.save_timeout_s,
                   help="a round whose state cannot be saved (full or failing disk) waits "
                        "and retries this long, then the syncer exits non-zero; the disk "
                        "keeps the last committed round for --resume")


def config_from_args(args: argparse.Namespace) -> Config:
    """The run's `Config` from parsed flags (the flags' defaults are Config's)."""
    if args.quorum < 1:
        sys.exit("error: --quorum must be at least 1 (example: --quorum 2 for two islands)")
    bounds = Bounds(max_delta=args.max_delta, norm_factor=args.norm_factor,
                    max_tokens_per_step=args.max_tokens_per_step,
                    max_steps_per_push=args.max_steps_per_push, max_params=args.max_params,
                    max_share=args.max_share, center_factor=args.center_factor,
                    max_steps_per_second=args.max_steps_per_second)
    return round_config(args, quorum=args.quorum, rounds=args.rounds, bounds=bounds,
                        save_timeout_s=args.save_timeout_s,
                        state_dir=args.state_dir, resume=args.resume,
                        trust_unkeyed_state=args.trust_unkeyed_state,
                        shard=_shard(args.shard),
                        seed_from=args.seed_from,
                        expect_islands=tuple(x.strip() for x in
                                             (args.expect_islands or "").split(",") if x.strip()))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The syncer's flags, with the run file's values (``--config``) under them."""
    return runfile.parse(build_parser(), argv, "syncer", programs={"island": island_parser})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _check_state_dir(args.state_dir)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s syncer %(message)s",
                        datefmt="%H:%M:%S")
    token = net.token_from_env(args.token)
    tls = _tls_credentials(args)
    _refuse_open_listening(args, token, tls)
    cfg = config_from_args(args)
    cfg.token = token  # keys the state's digest (syncer.persist.Store)
    cfg.peer_tls = peer_tls(*tls) if tls else None  # to a standby, or to the primary
    memory.limit_arenas()  # freed chunk buffers reused from two arenas, not kept in 16
    if args.standby_of:
        args.port = _stand_by(args, cfg, token, tls)  # returns once it takes over
        cfg.resume = True
    try:
        run = Run(cfg)
    except (StateError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.standby_of:
        try:
            run.take_over(args.standby_of)
        except OSError as e:
            sys.exit(f"error: cannot save the takeover's state in {cfg.state_dir}: {e}")
    die_with_threads()
    try:
        server, port = serve(run, args.host, args.port, token=token, tls=tls,
                             max_inflight_pushes=max(1, args.max_inflight_pushes),
                             spill_min_bytes=int(args.spill_min_mib * 2**20),
                             streams=Streams(max(1, args.max_streams),
                                             idle_s=max(0.1, args.stream_idle_s)),
                             direct_port=None if args.no_direct else args.direct_port)
    except OSError as e:
        sys.exit(f"error: {e}")
    dashboard = _start_dashboard(run, args, token, server)

    def announce() -> None:  # once a signal stops it cleanly: whoever reads the port may
        if args.port_file:   # send one at once
            atomic_write(args.port_file, str(port))
        log.info("listening on %s (quorum %d, rounds %s, merge %s, outer lr %g momentum %g)",
                 host_port(args.host, port), cfg.quorum, cfg.rounds or "until islands finish",
                 cfg.merge, cfg.outer_lr, cfg.outer_momentum)
        log.info("q4 sums: %s", kernels.describe())
    return _serve_until_done(run, server, dashboard, announce)


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as e:
        sys.exit(f"error: {e}")


def _stand_by(args: argparse.Namespace, cfg: Config, token: str | None, tls: TLSFiles | None
              ) -> int:
    """Serve as a standby (`syncer.standby`) until the primary stops answering; returns
    the port, freed for the run this syncer now serves. A signal ends it (exit 0)."""
    import grpc

    from syncer.standby import Standby, StandbyService
    from syncer.state import StateKey
    from yeto.proto import yeto_pb2_grpc as pb_grpc

    if cfg.state_dir is None:
        sys.exit("error: --standby-of needs --state-dir (where the primary's states are kept)")
    if tls and not token:
        sys.exit("error: --standby-of with TLS needs the run's --token (or $YETO_TOKEN): "
                 "only the run's secret registers a standby and sends it states")
    if args.takeover_after_s <= 0:
        sys.exit("error: --takeover-after-s must be positive")
    try:
        net.parse_address(args.standby_of)
    except ValueError as e:
        sys.exit(f"error: --standby-of: {e}")
    server = grpc.server(ThreadPoolExecutor(max_workers=8),
                         options=net.SERVER_OPTIONS + EXCLUSIVE_PORT)
    try:
        port = listen(server, host_port(args.host, args.port), tls)
    except RuntimeError:
        port = 0
    if port == 0:
        sys.exit(f"error: cannot listen on {host_port(args.host, args.port)}")
    advertise = args.advertise or host_port(args.host, port)
    try:
        standby = Standby(cfg.state_dir, StateKey(token), args.standby_of, advertise,
                          args.takeover_after_s, 12 * cfg.bounds.max_params + (64 << 20),
                          cfg.peer_tls)
    except StateError as e:
        sys.exit(f"error: {e}")
    pb_grpc.add_SyncerServicer_to_server(StandbyService(standby, token), server)
    server.start()
    if args.port_file:
        atomic_write(args.port_file, str(port))
    log.info("standby of %s on %s (reached at %s), holding version %d", args.standby_of,
             host_port(args.host, port), advertise, standby.version)
    with GracefulStop() as stop:
        took_over = standby.watch(stop.event, token)
    server.stop(grace=0).wait()
    if not took_over:
        log.info("standby stopped")
        sys.exit(0)
    log.warning("the primary %s has not answered for %.0f s: taking the run over at "
                "version %d", args.standby_of, args.takeover_after_s, standby.version)
    return port


def _tls_credentials(args: argparse.Namespace) -> TLSFiles | None:
    if not (args.tls_cert or args.tls_key):
        return None
    if not (args.tls_cert and args.tls_key):
        sys.exit("error: --tls-cert and --tls-key go together (example: --tls-cert "
                 "server.pem --tls-key server.key)")
    try:  # checked here: gRPC would read them only at the first handshake
        return (net.read_pem(args.tls_cert, "--tls-cert"),
                net.read_pem(args.tls_key, "--tls-key"),
                net.read_pem(args.tls_ca, "--tls-ca") if args.tls_ca else None)
    except net.TLSFileError as e:
        sys.exit(f"error: {e}")


def _check_state_dir(state_dir: Path | None) -> None:
    """Refuse, in one line, a --state-dir the syncer cannot write (read-only, under a
    file, not a dir), before anything starts; create a missing one private (0700: it
    holds the run's weights)."""
    if state_dir is None:
        return
    probe = state_dir / f".yeto-write-probe-{os.getpid()}"
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        what = {FileExistsError: "is a file, not a directory",
                NotADirectoryError: "is under a file (part of its path is not a directory)",
                }.get(type(e), f"cannot be written ({e.strerror})")
        sys.exit(f"error: --state-dir {state_dir} {what}: pass a directory this user can "
                 "create and write, e.g. --state-dir runs/syncer")


def _refuse_open_listening(args: argparse.Namespace, token: str | None,
                           tls: TLSFiles | None) -> None:
    if net.is_loopback(args.host, resolve=True) or token or tls or args.insecure:
        return
    sys.exit(f"error: refusing to listen on {args.host} without a token or TLS: anyone who "
             "can reach the port could join. Example:\n"
             f"  {net.TOKEN_ENV}=$(openssl rand -hex 16) python -m syncer --host {args.host}"
             "\n(or pass --insecure on a trusted network)")


def _start_dashboard(run: Run, args: argparse.Namespace, token: str | None,
                     server: SyncerServer) -> DashboardServer | None:
    if args.dashboard_port is None:
        return None
    from syncer.dashboard import DashboardError, ShardView, start_dashboard

    shards = None
    if args.dashboard_shards:
        mine = run.cfg.shard.index
        try:  # each shard's primary (the first address of its entry); "self" for this one
            firsts = [e.split(",")[0].strip() for e in net.shard_entries(args.dashboard_shards)]
            for pos, a in enumerate(firsts):
                if not (pos == mine and a == "self"):
                    net.parse_address(a)
        except ValueError as e:
            server.stop(grace=0)
            sys.exit(f"error: --dashboard-shards: {e}")
        shards = ShardView(firsts, token, run.cfg.peer_tls, own=(mine, run.status))
    try:
        dashboard = start_dashboard(run, args.dashboard_host, args.dashboard_port,
                                    token=token, insecure=args.insecure, shards=shards)
    except DashboardError as e:
        server.stop(grace=0)
        sys.exit(f"error: {e}")
    log.info("dashboard on %s%s", dashboard.url,
             f" (every shard: {args.dashboard_shards})" if shards else "")
    if args.dashboard_port_file:
        atomic_write(args.dashboard_port_file, str(dashboard.port))
    return dashboard


def _serve_until_done(run: Run, server: SyncerServer, dashboard: DashboardServer | None,
                      announce: Callable[[], None] = lambda: None) -> int:
    """Serve until the run finishes (and islands have its final weights) or a signal
    comes. First SIGINT/SIGTERM: stop cleanly (the state on disk is the last committed
    round's, saved as it committed); second: stop at once. `announce()` says where it
    listens, once the signals are handled."""
    def first(name: str) -> None:
        log.warning("%s: stopping cleanly at version %d (send it again to stop at once)",
                    name, run.version)

    with GracefulStop(on_first=first) as stop:
        announce()
        try:
            _wait_for_finish(run, stop.event)
            _shutdown(run, server, dashboard, grace_s=0.0 if run.fatal else 2.0)
        except KeyboardInterrupt:
            log.warning("stopping at once")
            _shutdown(run, server, dashboard, grace_s=0.0)
            return 130
    ignore_signals()
    if run.fatal:
        print(f"error: {run.fatal}", file=sys.stderr)
        return 1
    log.info("stopped at version %d", run.version)
    return 0


def _wait_for_finish(run: Run, stop: threading.Event) -> None:
    while not run.finished:
        if stop.wait(0.2) or run.fatal:
            return
    # let islands receive the final broadcast before the server goes away
    drain_until = time.monotonic() + FINAL_DRAIN_S
    while run.finished and not run.final_done() and time.monotonic() < drain_until:
        if stop.wait(0.1):
            return
    # a standby that does not hear it would take the finished run over
    tell_until = time.monotonic() + STANDBY_TELL_S
    while run.finished and not run.standbys_told() and time.monotonic() < tell_until:
        if stop.wait(0.1):
            return


def _shutdown(run: Run, server: SyncerServer, dashboard: DashboardServer | None,
              grace_s: float) -> None:
    run.close()
    server.ticker_stop.set()
    server.stop(grace=grace_s).wait()
    if dashboard is not None:
        dashboard.stop()
    run.tape.close()


if __name__ == "__main__":
    sys.exit(main())
