"""The processes of `yeto launch`: a syncer and its islands as children of the launcher,
reserved slots for islands on other machines, and stopping them in order.

`LocalRun` starts and stops; what the processes report is read by its `progress`
(`yeto.cli.progress.Progress`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from syncer.spawn import SyncerProcess, SyncerStartError, start_syncer
from yeto import net
from yeto.backends import BACKENDS
from yeto.cli import join
from yeto.cli.progress import IslandProc, Progress, summarize
from yeto.io import JsonlFollower, atomic_write, write_private

log = logging.getLogger("yeto.cli.launch")


# flags of the torch island that an MLX island does not take (it refuses them)
TORCH_ONLY = ("--threads", "--device")


def without_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` without `flags` and their values (as `--flag V` or `--flag=V`)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


@dataclass
class LaunchConfig:
    out: Path
    backends: list[str]
    model: str
    data: str
    eval_data: str | None = None
    island_args: list[str] = field(default_factory=list)
    backend_args: dict[str, list[str]] = field(default_factory=dict)
    syncer_args: list[str] = field(default_factory=list)
    quorum: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    dashboard_port: int | None = 0      # None = no dashboard
    display: str = "auto"               # auto | live | plain | none
    report_to: tuple[str, ...] = ()
    stop_timeout_s: float = 120.0
    keep_going: bool = False
    max_steps: int | None = None        # for the display only
    overwrite: bool = False
    status_every_s: float = 30.0        # plain display: a table this often
    external: list[str] = field(default_factory=list)  # reserved slots: any | torch | mlx
    advertise_host: str | None = None   # what other machines dial (default: see join.py)
    tls_cert: Path | None = None        # the syncer's certificate and key: TLS on
    tls_key: Path | None = None
    tls_ca: Path | None = None          # what islands trust (default: tls_cert)
    shards: int = 1                     # syncer shards (--shard I/S); 1: one syncer

    @property
    def num_islands(self) -> int:
        return len(self.backends) + len(self.external)

    @property
    def island_ca(self) -> Path | None:
        return self.tls_ca or self.tls_cert


class LaunchError(RuntimeError):
    """The run could not start (the message says why and what to do)."""


class LocalRun:
    """A syncer and islands as child processes of this one (each in its own session,
    so a terminal's Ctrl-C reaches only the launcher, which then stops them in order)."""

    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.out = cfg.out.resolve()
        self.syncer_dir = self.out / "syncer"  # shard 0's; shard i > 0: syncer-<i>
        self.islands: list[IslandProc] = []
        self.progress = Progress(self.out, self.islands, cfg.report_to)
        self.syncer: SyncerProcess | None = None  # shard 0 (the one syncer when unsharded)
        self.shards: list[SyncerProcess] = []
        self.address = ""
        self.dashboard_url: str | None = None
        self.stopping: str | None = None   # why, once a stop began
        self.stop_started = 0.0
        self.hard_stop = False
        self.t0 = time.monotonic()
        self._logs: list = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.token = cfg.token
        self.token_file: Path | None = None   # a token the launcher generated
        self.join_address = ""                # what external islands dial
        if cfg.token:
            self.env[net.TOKEN_ENV] = cfg.token  # not on the command line (visible in ps)

    # ---- start ------------------------------------------------------------------
    def prepare(self) -> None:
        """Refuse (or, with overwrite, clear) an earlier run's outputs in --out."""
        for p in (*(self.shard_dir(i) for i in range(self.cfg.shards)),
                  *(self.out / sub for sub in ("islands", "adapter", "tensorboard"))):
            if p.is_dir() and any(p.iterdir()):
                if not self.cfg.overwrite:
                    raise LaunchError(f"{p} already holds a run's outputs: pass --overwrite to "
                                      "replace them, or choose another --out")
                shutil.rmtree(p, ignore_errors=True)
        for name in ("summary.json", "join.txt", "token"):
            (self.out / name).unlink(missing_ok=True)
        self.syncer_dir.mkdir(parents=True, exist_ok=True)
        self.progress.track("syncer")
        if self.cfg.external:
            self._prepare_external()

    def _prepare_external(self) -> None:
        """Check that other machines can reach the syncer; without a token, make one
        (in OUT/token, readable by this user only: it is never printed)."""
        try:
            join.advertise_host(self.cfg.host, self.cfg.advertise_host)
        except join.JoinError as e:
            raise LaunchError(str(e)) from None
        if self.token:
            return
        self.token = secrets.token_hex(16)
        self.token_file = self.out / "token"
        write_private(self.token_file, self.token + "\n")
        self.env[net.TOKEN_ENV] = self.token

    def start_syncer(self, timeout: float = 60.0) -> str:
        """Start the syncer, or each of --shards shards (each in its own session, its log
        in its state dir's log.txt); returns the address islands dial ('A;B' for shards)."""
        quorum = self.cfg.quorum or self.cfg.num_islands
        tls = ["--tls-cert", str(self.cfg.tls_cert), "--tls-key", str(self.cfg.tls_key)] \
            if self.cfg.tls_cert else []
        slots = [iid for _, iid, _ in self._slots()]
        expect = ["--expect-islands", ",".join(slots)] if slots else []
        n = self.cfg.shards
        for i in [*range(1, n), 0]:  # shard 0, whose dashboard shows them all, last
            state_dir = self.shard_dir(i)
            state_dir.mkdir(parents=True, exist_ok=True)
            shard = ["--shard", f"{i}/{n}", "--seed-from", "island-0"] if n > 1 else []
            if i == 0 and n > 1 and self.cfg.dashboard_port is not None:
                shard += ["--dashboard-shards",
                          ";".join(["self", *(s.address for s in self.shards)])]
            try:
                self.shards.append(start_syncer(
                    ["--quorum", str(quorum), "--state-dir", str(state_dir), *tls, *expect,
                     *shard, *self.cfg.syncer_args],
                    host=self.cfg.host, port=self.cfg.port if i == 0 else 0,
                    port_file=state_dir / "port",
                    dashboard_port=self.cfg.dashboard_port if i == 0 else None, env=self.env,
                    log=state_dir / "log.txt", timeout_s=timeout, new_session=True))
            except (SyncerStartError, ValueError) as e:
                raise LaunchError(f"{e}\n(the syncer's log: {state_dir / 'log.txt'})") \
                    from None
        self.shards = self.shards[-1:] + self.shards[:-1]  # in shard order: 0, 1, ...
        self.syncer = self.shards[0]
        self.address = ";".join(s.address for s in self.shards)
        self.dashboard_url = self.syncer.dashboard_url
        if self.cfg.external or self.cfg.advertise_host:
            self.join_address = join.join_address(self.cfg.host, self.syncer.port,
                                                  self.cfg.advertise_host)
            if self.cfg.tls_cert:  # the certificate names the address others dial
                self.address = self.join_address
        return self.address

    def shard_dir(self, i: int) -> Path:
        """Shard i's state dir: OUT/syncer for shard 0 (the one syncer, unsharded), else
        OUT/syncer-<i>."""
        return self.syncer_dir if i == 0 else self.out / f"syncer-{i}"

    def island_command(self, index: int, backend: str, out_dir: Path) -> list[str]:
        """The island program (``python -m yeto.learner`` / ``yeto.mlx.learner``) and its
        flags: the run's model and data, this island's id and output, the shared flags."""
        n = self.cfg.num_islands
        shared = self.cfg.island_args
        if backend != "torch":  # torch's own flags (CPU threads, device) stay with torch
            shared = without_flags(shared, TORCH_ONLY)
        extra = list(self.cfg.backend_args.get(backend, []))
        if backend == "torch" and "--threads" not in self.cfg.island_args + extra:
            extra += ["--threads", str(max(1, (os.cpu_count() or 1) // len(self.cfg.backends)))]
        if self.cfg.island_ca is not None:
            extra += ["--tls-ca", str(self.cfg.island_ca)]
        return [sys.executable, "-m", BACKENDS[backend].module,
                "--model", str(self.cfg.model), "--data", str(self.cfg.data),
                *(["--eval-data", str(self.cfg.eval_data)] if self.cfg.eval_data else []),
                "--syncer", self.address, "--learner-id", f"island-{index}",
                "--num-learners", str(n), "--output", str(out_dir), "--no-progress",
                *shared, *extra]

    def start_islands(self) -> None:
        for i, backend in enumerate(self.cfg.backends):
            iid = f"island-{i}"
            d = self.out / "islands" / iid
            d.mkdir(parents=True, exist_ok=True)
            isl = IslandProc(iid, backend, d, self.island_command(i, backend, d),
                             metrics=JsonlFollower(d / "metrics.jsonl"))
            logf = open(d / "log.txt", "w")  # noqa: SIM115 - closed by close()
            self._logs.append(logf)
            isl.proc = subprocess.Popen(isl.cmd, stdout=logf, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
            self.islands.append(isl)
            self.progress.track(iid)

    def reserve_external(self) -> list[str]:
        """An `IslandProc` per reserved slot (after the local islands: island-L, ...),
        with its own credential in OUT/credentials/<id> when the run has a token; returns
        the join commands to print (also written to OUT/join.txt)."""
        spec = join.JoinSpec(
            address=self.join_address, model=str(self.cfg.model), data=str(self.cfg.data),
            num_learners=self.cfg.num_islands,
            eval_data=str(self.cfg.eval_data) if self.cfg.eval_data else None,
            island_args=list(self.cfg.island_args), backend_args=self.cfg.backend_args,
            tls_ca=self.cfg.island_ca.resolve() if self.cfg.island_ca else None,
            token_hint=join.credential_hint(self.out) if self.token else None)
        lines: list[str] = []
        for index, iid, kind in self._slots():
            if self.token:
                join.write_credential(self.out, self.token, iid)
            argv = join.island_argv(spec, "torch" if kind == "any" else kind, iid, index)
            self.islands.append(IslandProc(iid, kind, self.out / "external" / iid, argv,
                                           external=True))
            lines += join.join_block(spec, kind, iid, index) + [""]
        atomic_write(self.out / "join.txt", "\n".join(lines))
        return lines

    def _slots(self) -> list[tuple[int, str, str]]:
        """(index, learner id, kind) of each reserved slot: they follow the local islands."""
        first = len(self.cfg.backends)
        return [(first + k, f"island-{first + k}", kind)
                for k, kind in enumerate(self.cfg.external)]

    # ---- follow -----------------------------------------------------------------
    def poll(self, with_status: bool = True) -> tuple[list[dict], list[IslandProc]]:
        """What is new (see `Progress.poll`); the syncer's Status too when `with_status`
        and the syncer runs."""
        alive = with_status and self.address and self.syncer and self.syncer.poll() is None
        return self.progress.poll(self._fetch_status if alive else None)

    def _fetch_status(self) -> dict:
        """The syncer's Status; with shards, shard 0's with each island over all of them."""
        from yeto.cli.status import fetch
        from yeto.client.connection import merged_islands

        tls = None
        if self.cfg.island_ca is not None:
            from yeto.client import TLSConfig

            tls = TLSConfig(ca=self.cfg.island_ca.read_bytes())
        got = [fetch(a, self.token, tls=tls, timeout=2.0) for a in self.address.split(";")]
        return dict(got[0], islands=merged_islands(got)) if len(got) > 1 else got[0]

    def external(self) -> list[IslandProc]:
        return [i for i in self.islands if i.external]

    def running(self) -> list[IslandProc]:
        """Local islands still running."""
        return [i for i in self.islands if i.code is None and not i.external]

    def awaiting_external(self) -> bool:
        """External slots whose islands may still be training (the syncer runs and no
        stop was asked for): the launcher stays with the run."""
        return bool(self.external()) and self.stopping is None and \
            self.syncer is not None and self.syncer.poll() is None

    def waiting_slots(self) -> list[IslandProc]:
        return [i for i in self.external() if not i.syncer_state]

    def failed_syncer(self) -> tuple[int, Path] | None:
        """(exit code, its log) of the first syncer (shard) that exited non-zero."""
        for i, s in enumerate(self.shards):
            code = s.poll()
            if code not in (None, 0):
                return code, self.shard_dir(i) / "log.txt"
        return None

    def stopped_by_signal(self) -> bool:
        return bool(self.stopping and self.stopping.startswith("signal"))

    # ---- stop -------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """First call: SIGINT to the islands (finish and save). Second: stop at once
        (SIGTERM: an island's second signal)."""
        if self.stopping is None:
            self.stopping, self.stop_started = reason, time.monotonic()
            self._signal_islands(signal.SIGINT)
            if not self.progress.merges and self.waiting_slots():
                # still waiting for the quorum: nothing trained, nothing to save
                self.hard_stop = True
                self._signal_islands(signal.SIGTERM)
        elif not self.hard_stop:
            self.hard_stop = True
            self._signal_islands(signal.SIGTERM)

    def _signal_islands(self, sig) -> None:
        for isl in self.running():
            _send(isl.proc, sig)

    def escalate(self) -> None:
        """Called while stopping: SIGTERM after --stop-timeout, SIGKILL 15 s later."""
        if self.stopping is None or not self.running():
            return
        waited = time.monotonic() - self.stop_started
        if waited > self.cfg.stop_timeout_s and not self.hard_stop:
            log.warning("islands still running %.0f s after the stop: interrupting them", waited)
            self.hard_stop = True
            self._signal_islands(signal.SIGTERM)
        elif waited > self.cfg.stop_timeout_s + 15:
            self._signal_islands(signal.SIGKILL)

    def stop_syncer(self, wait_s: float = 60.0) -> int | None:
        """The syncer exits by itself once the run finished and the final weights went
        out; otherwise it gets SIGTERM (it saves state every round) after ``wait_s``.
        With shards: each in turn; the first non-zero exit code (else shard 0's)."""
        codes = [s.stop(grace_s=wait_s) for s in self.shards]
        return next((c for c in codes if c), codes[0] if codes else None)

    def kill_all(self) -> None:
        for isl in self.islands:
            if isl.proc is not None and isl.proc.poll() is None:
                _send(isl.proc, signal.SIGKILL)
                isl.proc.wait()
        for s in self.shards:
            s.kill()

    def close(self) -> None:
        for f in self._logs:
            f.close()
        self.progress.close()
        for s in self.shards:
            s.close()

    # ---- outputs ----------------------------------------------------------------
    def collect(self, seconds: float) -> dict | None:
        """Copy the syncer's final adapter to out/adapter (shards: assemble it from every
        shard's state, as `yeto export` does) and write summary.json."""
        final = self.syncer_dir / "final"
        if final.is_dir():
            shutil.rmtree(self.out / "adapter", ignore_errors=True)
            shutil.copytree(final, self.out / "adapter")
        elif self.cfg.shards > 1:
            self._assemble_shards()
        try:
            summary = summarize(self.out, seconds, [i.id for i in self.external()])
        except (OSError, ValueError, StopIteration):
            return None
        atomic_write(self.out / "summary.json", json.dumps(summary, indent=2))
        return summary

    def _assemble_shards(self) -> None:
        from yeto.interop.export import ExportError, export

        dirs = [self.shard_dir(i) for i in range(self.cfg.shards)]
        shutil.rmtree(self.out / "adapter", ignore_errors=True)
        try:
            export(dirs, self.out / "adapter", "peft")
        except ExportError as e:
            log.warning("the shards' states did not assemble into an adapter: %s", e)


def _send(proc: subprocess.Popen, sig) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass
