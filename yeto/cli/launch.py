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
import json
import logging
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from rich.console import Group
from rich.text import Text

from syncer.spawn import SyncerProcess, SyncerStartError, start_syncer
from yeto import net
from yeto.cli import join
from yeto.cli.display import Screen, human_bytes, human_seconds, table, to_text
from yeto.io import atomic_write, finite_or_none
from yeto.metrics import JsonlFollower, MetricsError, check_report_to, tape_scalars
from yeto.signals import GracefulStop

log = logging.getLogger("yeto.cli.launch")

ISLAND_MODULES = {"torch": "yeto.learner", "mlx": "yeto.mlx.learner"}
ISLAND_SCALARS = ("train_loss", "eval_loss", "tokens_per_s", "loss_tokens")  # to TensorBoard
# island flags the launcher sets itself
OWN_ISLAND_FLAGS = ("--syncer", "--learner-id", "--learner-index", "--num-learners", "--output",
                    "--model", "--data", "--eval-data", "--token", "--tls-ca", "--tls-cert",
                    "--tls-key")
SYNCER_FLAGS = {  # launch flag -> (syncer flag, type, default, help)
    "outer_lr": ("--outer-lr", float, None, "outer Nesterov learning rate (syncer default 1.0)"),
    "outer_momentum": ("--outer-momentum", float, None, "outer momentum (syncer default 0.0)"),
    "merge": ("--merge", str, None, "mean | uniform | rda (syncer default mean)"),
    "rounds": ("--rounds", int, None, "rounds to run (syncer default: until islands finish)"),
    "grace": ("--grace", str, None, "auto | fixed (syncer default auto)"),
    "grace_ms": ("--grace-ms", int, None, "straggler grace after the quorum's pushes"),
    "round_timeout_s": ("--round-timeout-s", float, None, "commit a round after this long"),
    "downlink": ("--downlink", str, None, "encoding of broadcasts: f32 | bf16 | q4"),
    "fragments": ("--fragments", int, None, "cut the weights into P fragments synced in turn"),
    "quorum": ("--quorum", int, None, "pushes that commit a round (default: every island)"),
}
# exit codes of an island stopped by the launcher's signals: 130 (it caught the
# interrupt), or killed by SIGINT (an interrupt it did not catch), SIGTERM, SIGKILL
STOPPED_CODES = (130, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL)
STATUS_EVERY_S = 1.0   # the syncer's Status, for the display
TICK_S = 0.25          # how often the launcher looks at its processes and files


# ---- one local run -------------------------------------------------------------------
@dataclass
class IslandProc:
    id: str
    backend: str
    dir: Path
    cmd: list[str]
    proc: subprocess.Popen | None = None
    metrics: JsonlFollower | None = None
    step: int = 0
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_before: float | None = None
    version: int | None = None
    tokens_per_s: float | None = None
    done: dict | None = None          # the final summary record, once written
    code: int | None = None
    t_first: float | None = None      # wall time of its step-0 record (training starts)
    t_tokens: float | None = None     # wall time of the last merge that counted its tokens
    loss_tokens: int = 0              # merged loss tokens (from the tape)
    syncer_state: str = ""
    pushes: int = 0
    last_contact_s: float | None = None
    external: bool = False            # a reserved slot: an island on another machine

    @property
    def state(self) -> str:
        if self.code is not None:
            return "done" if self.code == 0 else f"failed ({self.code})"
        if self.external:
            return self.syncer_state or "waiting (external)"
        return self.syncer_state or "starting"


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
        self.syncer_dir = self.out / "syncer"
        self.islands: list[IslandProc] = []
        self.syncer: SyncerProcess | None = None
        self.address = ""
        self.dashboard_url: str | None = None
        self.status: dict = {}
        self.merges: list[dict] = []
        self.rejected = 0
        self.tape = JsonlFollower(self.syncer_dir / "tape.jsonl")
        self.stopping: str | None = None   # why, once a stop began
        self.stop_started = 0.0
        self.hard_stop = False
        self.t0 = time.monotonic()
        self._logs: list = []
        self._tb: dict = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.token = cfg.token
        self.token_file: Path | None = None   # a token the launcher generated
        self.join_address = ""                # what external islands dial
        self.notes: list[str] = []            # lines for the display (islands joining)
        if cfg.token:
            self.env[net.TOKEN_ENV] = cfg.token  # not on the command line (visible in ps)

    # ---- start ------------------------------------------------------------------
    def prepare(self) -> None:
        """Refuse (or, with overwrite, clear) an earlier run's outputs in --out."""
        for sub in ("syncer", "islands", "adapter", "tensorboard"):
            p = self.out / sub
            if p.is_dir() and any(p.iterdir()):
                if not self.cfg.overwrite:
                    raise LaunchError(f"{p} already holds a run's outputs: pass --overwrite to "
                                      "replace them, or choose another --out")
                shutil.rmtree(p, ignore_errors=True)
        for name in ("summary.json", "join.txt", "token"):
            (self.out / name).unlink(missing_ok=True)
        self.syncer_dir.mkdir(parents=True, exist_ok=True)
        self._tensorboard("syncer")
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
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        self.env[net.TOKEN_ENV] = self.token

    def _tensorboard(self, name: str) -> None:
        if self.cfg.report_to:
            from yeto.metrics import MetricsWriter

            self._tb[name] = MetricsWriter(None, self.cfg.report_to,
                                           tb_dir=self.out / "tensorboard" / name)

    def _expected(self) -> list[str]:
        """The reserved slots' ids, for the syncer's status and dashboard."""
        first = len(self.cfg.backends)
        ids = [f"island-{first + k}" for k in range(len(self.cfg.external))]
        return ["--expect-islands", ",".join(ids)] if ids else []

    def start_syncer(self, timeout: float = 60.0) -> str:
        """Start the syncer (its own session, log in syncer/log.txt); returns its address."""
        quorum = self.cfg.quorum or self.cfg.num_islands
        tls = ["--tls-cert", str(self.cfg.tls_cert), "--tls-key", str(self.cfg.tls_key)] \
            if self.cfg.tls_cert else []
        try:
            self.syncer = start_syncer(
                ["--quorum", str(quorum), "--state-dir", str(self.syncer_dir), *tls,
                 *self._expected(), *self.cfg.syncer_args],
                host=self.cfg.host, port=self.cfg.port, port_file=self.syncer_dir / "port",
                dashboard_port=self.cfg.dashboard_port, env=self.env,
                log=self.syncer_dir / "log.txt", timeout_s=timeout, new_session=True)
        except (SyncerStartError, ValueError) as e:
            raise LaunchError(f"{e}\n(the syncer's log: {self.syncer_dir / 'log.txt'})") \
                from None
        self.address, self.dashboard_url = self.syncer.address, self.syncer.dashboard_url
        if self.cfg.external or self.cfg.advertise_host:
            self.join_address = join.join_address(self.cfg.host, self.syncer.port,
                                                  self.cfg.advertise_host)
            if self.cfg.tls_cert:  # the certificate names the address others dial
                self.address = self.join_address
        return self.address

    def island_command(self, index: int, backend: str, out_dir: Path) -> list[str]:
        """The island program (``python -m yeto.learner`` / ``yeto.mlx.learner``) and its
        flags: the run's model and data, this island's id and output, the shared flags."""
        n = self.cfg.num_islands
        extra = list(self.cfg.backend_args.get(backend, []))
        if backend == "torch" and "--threads" not in self.cfg.island_args + extra:
            extra += ["--threads", str(max(1, (os.cpu_count() or 1) // len(self.cfg.backends)))]
        if self.cfg.island_ca is not None:
            extra += ["--tls-ca", str(self.cfg.island_ca)]
        return [sys.executable, "-m", ISLAND_MODULES[backend],
                "--model", str(self.cfg.model), "--data", str(self.cfg.data),
                *(["--eval-data", str(self.cfg.eval_data)] if self.cfg.eval_data else []),
                "--syncer", self.address, "--learner-id", f"island-{index}",
                "--num-learners", str(n), "--output", str(out_dir), "--no-progress",
                *self.cfg.island_args, *extra]

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
            self._tensorboard(iid)

    # ---- external slots -----------------------------------------------------------
    def reserve_external(self) -> list[str]:
        """An `IslandProc` per reserved slot (after the local islands: island-L, ...);
        returns the join commands to print (also written to OUT/join.txt)."""
        spec = join.JoinSpec(
            address=self.join_address, model=str(self.cfg.model), data=str(self.cfg.data),
            num_learners=self.cfg.num_islands,
            eval_data=str(self.cfg.eval_data) if self.cfg.eval_data else None,
            island_args=list(self.cfg.island_args), backend_args=self.cfg.backend_args,
            tls_ca=self.cfg.island_ca.resolve() if self.cfg.island_ca else None,
            token_hint=self._token_hint())
        lines: list[str] = []
        for k, kind in enumerate(self.cfg.external):
            index = len(self.cfg.backends) + k
            iid = f"island-{index}"
            if self.token:
                self._write_credential(iid)
            argv = join.island_argv(spec, "torch" if kind == "any" else kind, iid, index)
            self.islands.append(IslandProc(iid, kind, self.out / "external" / iid, argv,
                                           external=True))
            lines += join.join_block(spec, kind, iid, index) + [""]
        atomic_write(self.out / "join.txt", "\n".join(lines))
        return lines

    def _write_credential(self, learner_id: str) -> Path:
        """OUT/credentials/<id>: the island's own credential (good for that id only; the
        run's token stays on this machine), readable by this user only."""
        folder = self.out / "credentials"
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / learner_id
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(net.island_credential(self.token, learner_id) + "\n")
        return path

    def _token_hint(self) -> str | None:
        """Where a slot's user finds its credential ("{id}": the slot's learner id)."""
        if not self.token:
            return None
        return (f"in {self.out / 'credentials'}/{{id}} on this machine, made from the run's "
                "token; good for {id} only")

    def external(self) -> list[IslandProc]:
        return [i for i in self.islands if i.external]

    # ---- follow -----------------------------------------------------------------
    def poll(self, with_status: bool = True) -> tuple[list[dict], list[IslandProc]]:
        """Read what is new; returns (new merge/rejection records, islands that just exited)."""
        exited = self._read_islands()
        new = self.tape.read_new()
        for rec in new:
            if rec.get("event") == "merge":
                self._merge_record(rec)
            elif rec.get("event") == "rejected":
                self.rejected += 1
        if with_status and self.address and self.syncer and self.syncer.poll() is None:
            self._poll_status()
        return new, exited

    def _read_islands(self) -> list[IslandProc]:
        exited = []
        for isl in self.islands:
            if isl.external:  # its metrics are on its own machine
                continue
            for rec in isl.metrics.read_new():
                self._island_record(isl, rec)
            if isl.code is None and isl.proc.poll() is not None:
                isl.code = isl.proc.returncode
                for rec in isl.metrics.read_new():
                    self._island_record(isl, rec)
                exited.append(isl)
        return exited

    def _merge_record(self, rec: dict) -> None:
        self.merges.append(rec)
        by_id = {i.id: i for i in self.islands}
        for r in rec.get("responders", []):
            isl = by_id.get(r.get("learner"))
            if isl is None:
                continue
            isl.pushes += 1
            # with --fragments P each fragment's pushes carry the tokens since that
            # fragment's last push: one fragment's pushes count each once
            if not rec.get("fragment"):
                isl.loss_tokens += int(r.get("tokens") or 0)
                isl.t_tokens = finite_or_none(rec.get("time")) or time.time()
                if isl.external:  # what the tape tells of an island on another machine
                    self._joined(isl, None)
                    _external_record(isl, rec, r)
        w = self._tb.get("syncer")
        if w is not None:
            for prefix, scalars in tape_scalars(rec).items():
                w.scalars(scalars, rec.get("round"), prefix=prefix)

    def _island_record(self, isl: IslandProc, rec: dict) -> None:
        if "eval_loss_before" in rec:  # the summary record written at the end
            isl.done = rec
        if rec.get("step") == 0 and isl.t_first is None:
            isl.t_first = finite_or_none(rec.get("time")) or time.time()
            isl.eval_before = finite_or_none(rec.get("eval_loss"))
        if isinstance(rec.get("step"), int):
            isl.step = max(isl.step, rec["step"])
        for k in ("train_loss", "eval_loss", "tokens_per_s"):
            if finite_or_none(rec.get(k)) is not None:
                setattr(isl, k, finite_or_none(rec[k]))
        if isinstance(rec.get("version"), int):
            isl.version = rec["version"]
        w = self._tb.get(isl.id)
        if w is not None and isinstance(rec.get("step"), int) and "eval_loss_before" not in rec:
            w.scalars({k: v for k, v in rec.items() if k in ISLAND_SCALARS}, rec["step"])

    def _poll_status(self) -> None:
        from yeto.cli.status import fetch

        tls = None
        if self.cfg.island_ca is not None:
            from yeto.client import TLSConfig

            tls = TLSConfig(ca=self.cfg.island_ca.read_bytes())
        try:
            self.status = fetch(self.address, self.token, tls=tls, timeout=2.0)
        except Exception:  # noqa: BLE001 - the display keeps its last view
            return
        by_id = {i["learner_id"]: i for i in self.status.get("islands", [])}
        for isl in self.islands:
            s = by_id.get(isl.id)
            if s is None or s["state"] == "reserved":  # a slot the syncer still waits for
                continue
            if isl.external:
                self._joined(isl, s.get("backend"))
            isl.syncer_state, isl.last_contact_s = s["state"], s.get("last_contact_s")

    def _joined(self, isl: IslandProc, backend: str | None) -> None:
        """An external island seen for the first time (in the Status or the tape)."""
        if backend and backend in ISLAND_MODULES:
            isl.backend = backend
        if isl.syncer_state:
            return
        isl.syncer_state = "training"
        isl.t_first = time.time()
        self.notes.append(f"{isl.id} joined from another machine ({isl.backend})")

    def rate(self, isl: IslandProc) -> float | None:
        """Loss tokens per second: the island's own figure when its metrics carry one,
        else the loss tokens merged from it over the time from its step 0 to its last
        merged push (waits for rounds included)."""
        if isl.tokens_per_s is not None:
            return isl.tokens_per_s
        if isl.t_first is None or isl.t_tokens is None or isl.t_tokens <= isl.t_first:
            return None
        return isl.loss_tokens / (isl.t_tokens - isl.t_first)

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

    def stopped_by_signal(self) -> bool:
        return bool(self.stopping and self.stopping.startswith("signal"))

    # ---- stop -------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """First call: SIGINT to the islands (finish and save). Second: stop at once
        (SIGTERM: an island's second signal)."""
        if self.stopping is None:
            self.stopping, self.stop_started = reason, time.monotonic()
            self._signal_islands(signal.SIGINT)
            if not self.merges and self.waiting_slots():
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
        out; otherwise it gets SIGTERM (it saves state every round) after ``wait_s``."""
        return self.syncer.stop(grace_s=wait_s) if self.syncer is not None else None

    def kill_all(self) -> None:
        for isl in self.islands:
            if isl.proc is not None and isl.proc.poll() is None:
                _send(isl.proc, signal.SIGKILL)
                isl.proc.wait()
        if self.syncer is not None:
            self.syncer.kill()

    def close(self) -> None:
        for f in self._logs:
            f.close()
        for w in self._tb.values():
            w.close()
        if self.syncer is not None:
            self.syncer.close()

    # ---- outputs ----------------------------------------------------------------
    def collect(self, seconds: float) -> dict | None:
        """Copy the syncer's final adapter to out/adapter and write summary.json."""
        final = self.syncer_dir / "final"
        if final.is_dir():
            shutil.rmtree(self.out / "adapter", ignore_errors=True)
            shutil.copytree(final, self.out / "adapter")
        try:
            summary = summarize(self.out, seconds, [i.id for i in self.external()])
        except (OSError, ValueError, StopIteration):
            return None
        atomic_write(self.out / "summary.json", json.dumps(summary, indent=2))
        return summary


def _external_record(isl: IslandProc, rec: dict, r: dict) -> None:
    """An external island's step, losses and round, from its responder entry."""
    isl.step += int(r.get("steps") or 0)
    isl.version = rec.get("round", isl.version)
    for k in ("train_loss", "eval_loss"):
        if finite_or_none(r.get(k)) is not None:
            setattr(isl, k, finite_or_none(r[k]))


def _send(proc: subprocess.Popen, sig) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join("    " + line for line in text[-lines:])


def summarize(out: Path, seconds: float, external: list[str] = ()) -> dict:
    """summary.json of a local run (the format `yeto demo` has always written):
    held-out loss before/after (island-0's), rounds, bytes up/down, seconds, and
    per island its held-out loss, loss tokens and whether it got the final weights;
    per external slot, from the tape: merged pushes and loss tokens (its own outputs
    are on its machine)."""
    from syncer.tape import read_tape

    tape = out / "syncer" / "tape.jsonl"
    merges = [r for r in read_tape(tape) if r.get("event") == "merge"] if tape.exists() else []
    islands = {}
    for d in sorted((out / "islands").iterdir()) if (out / "islands").is_dir() else ():
        if (d / "summary.json").is_file():
            islands[d.name] = json.loads((d / "summary.json").read_text())
    first = next(iter(islands.values()), {})
    ext = {k: dict(pushes=0, loss_tokens=0) for k in external}
    for r in (x for m in merges for x in m.get("responders", []) if not m.get("fragment")):
        if r.get("learner") in ext:
            ext[r["learner"]]["pushes"] += 1
            ext[r["learner"]]["loss_tokens"] += int(r.get("tokens") or 0)
    return dict(eval_loss_before=finite_or_none(first.get("eval_loss_before")),
                eval_loss_after=finite_or_none(first.get("eval_loss")),
                rounds=len(merges), bytes_up=sum(r["bytes_in"] for r in merges),
                bytes_down=sum(r["bytes_out"] for r in merges), seconds=round(seconds, 1),
                islands={k: dict(eval_loss=finite_or_none(v.get("eval_loss")),
                                 loss_tokens=v.get("loss_tokens"),
                                 final=v.get("final")) for k, v in islands.items()},
                **(dict(external=ext) if ext else {}))


# ---- display ---------------------------------------------------------------------------
ISLAND_COLUMNS = ["island", "backend", "step", "train loss", "held-out", "loss tok/s", "round",
                  "pushes", "state"]


def _loss(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


def run_state(run: LocalRun) -> str:
    if run.stopping and run.running():
        return "stopping: " + run.stopping
    if run.status.get("finished") or (run.syncer and run.syncer.poll() == 0 and not
                                      (run.hard_stop and not run.merges)):
        return "finished"
    if run.stopping:
        return "stopped: " + run.stopping
    return "training" if run.merges or run.status.get("version") else "starting"


def headline(run: LocalRun) -> str:
    m = run.merges
    waiting = run.waiting_slots()
    wait = f"  waiting for {len(waiting)} external island{'s' if len(waiting) > 1 else ''}" \
        if waiting else ""
    return (f"syncer {run.join_address or run.address}  {run_state(run)}{wait}  "
            f"round {m[-1]['round'] if m else 0}  "
            f"merges {len(m)}  up {human_bytes(sum(r.get('bytes_in', 0) for r in m))}  down "
            f"{human_bytes(sum(r.get('bytes_out', 0) for r in m))}  rejected {run.rejected}  "
            f"{human_seconds(time.monotonic() - run.t0)}")


def island_row(run: LocalRun, isl: IslandProc) -> list[str]:
    steps, rate = run.cfg.max_steps, run.rate(isl)
    if isl.external and not isl.syncer_state:
        return [isl.id, isl.backend, "-", "-", "-", "-", "-", "0", isl.state]
    return [isl.id, isl.backend, f"{isl.step}/{steps}" if steps else str(isl.step),
            _loss(isl.train_loss), _loss(isl.eval_loss),
            "-" if rate is None else f"{rate:,.0f}",
            "-" if isl.version is None or isl.version < 0 else str(isl.version),
            str(isl.pushes), isl.state]


def view(run: LocalRun) -> Group:
    """The run at a glance: a headline and a row per island."""
    islands = sorted(run.islands, key=lambda i: (len(i.id), i.id))  # island-2 before -10
    return Group(Text(headline(run)),
                 table(ISLAND_COLUMNS, [island_row(run, isl) for isl in islands]))


def render_table(run: LocalRun) -> str:
    """`view` as plain text."""
    return to_text(view(run))


def merge_line(r: dict) -> str:
    parts = [f"{x['learner']} {x['tokens']} tok"
             + (f" eval {x['eval_loss']:.3f}" if x.get("eval_loss") is not None else "")
             for x in r.get("responders", [])]
    return f"round {r['round']:3d}: " + ", ".join(parts)


def event_lines(new: list[dict], exited: list[IslandProc]) -> list[str]:
    """A line per merged round, refused message and exited island."""
    lines = [merge_line(r) for r in new if r.get("event") == "merge"]
    lines += [f"rejected: {r.get('learner')} {r.get('kind')}: {r.get('detail')}"
              for r in new if r.get("event") == "rejected"]
    lines += [f"{isl.id} exited with code {isl.code}" if isl.code else
              f"{isl.id} done at step {isl.step}" for isl in exited]
    return lines


class Display:
    """live: the run's view redrawn in place (a terminal), event lines above it; plain:
    a line per merged round and per island that exits, and the view every
    `status_every_s`; none: quiet."""

    def __init__(self, mode: str, stream=None, status_every_s: float = 30.0):
        self.screen = Screen(mode, stream)
        self.mode = self.screen.mode
        self.status_every_s = status_every_s
        self._last_view = time.monotonic()

    def say(self, text: str) -> None:
        self.screen.say(text)

    def update(self, run: LocalRun, new: list[dict], exited: list[IslandProc]) -> None:
        notes, run.notes = run.notes, []
        if self.mode == "none":
            return
        for line in notes + event_lines(new, exited):
            self.screen.say(line)
        if self.mode == "live" or time.monotonic() - self._last_view >= self.status_every_s:
            self._last_view = time.monotonic()
            self.screen.show(view(run))

    def show(self, run: LocalRun) -> None:
        """The run's view now (plain: printed once; live: redrawn)."""
        if self.mode != "none":
            self._last_view = time.monotonic()
            self.screen.show(view(run))

    def final(self, run: LocalRun | None) -> None:
        """The last view (and the end of a live region)."""
        self.screen.close(view(run) if run is not None and self.mode != "none" else None)


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
    if run.syncer.poll() not in (None, 0) and run.stopping is None:
        # (code 0: the run finished and the final weights went out; the islands are
        # saving their outputs and exit by themselves)
        display.say(f"error: the syncer exited with code {run.syncer.returncode}:\n"
                    + tail(run.syncer_dir / "log.txt"))
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
    p.add_argument("--port", type=int, default=None,
                   help=f"syncer port (default: any free port; {net.DEFAULT_PORT} with "
                        "--external-islands, so a firewall can be opened for it)")
    p.add_argument("--token", default=None,
                   help="shared token for the syncer and islands (default: $YETO_TOKEN; "
                        "with --external-islands and none given, one is generated into "
                        "OUT/token)")
    _add_external_args(p)
    p.add_argument("--dashboard-port", type=int, default=0,
                   help="the syncer's dashboard port (default 0: any free port)")
    p.add_argument("--no-dashboard", action="store_true", help="no dashboard")
    p.add_argument("--syncer-args", default="", help="extra flags for the syncer "
                                                     "(python -m syncer --help)")
    for name, (flag, typ, default, text) in SYNCER_FLAGS.items():
        p.add_argument(flag, dest=name, type=typ, default=default, help=text)
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
    bad = [b for b in backends if b not in ISLAND_MODULES]
    if bad or not (backends or external):
        p.error(f"--islands {args.islands!r}: use a comma list of {', '.join(ISLAND_MODULES)}, "
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
    for name, (flag, _, _, _) in SYNCER_FLAGS.items():
        value = getattr(args, name)
        if value is not None and name != "quorum":
            syncer_args += [flag, str(value)]
    steps = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    steps.add_argument("--max-steps", type=int, default=None)
    known, _ = steps.parse_known_args(rest)
    return LaunchConfig(
        out=args.out, backends=backends, model=args.model, data=args.data,
        eval_data=args.eval_data, island_args=rest,
        backend_args={"torch": shlex.split(args.torch_args), "mlx": shlex.split(args.mlx_args)},
        syncer_args=syncer_args, quorum=args.quorum, host=args.host,
        port=args.port if args.port is not None else net.DEFAULT_PORT if external else 0,
        external=external, advertise_host=args.advertise_host, tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_ca=args.tls_ca,
        token=args.token or os.environ.get("YETO_TOKEN") or None,
        dashboard_port=None if args.no_dashboard else args.dashboard_port,
        display=args.display, report_to=report_to, stop_timeout_s=args.stop_timeout,
        keep_going=args.keep_going, max_steps=known.max_steps or 200, overwrite=args.overwrite)


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
    if (out / "adapter").is_dir():
        print(f"  adapter/         the final adapter (peft; `yeto export --state-dir "
              f"{out / 'syncer'} --format mlx --out DIR` for mlx-lm)", file=stream)
    else:
        print("  (no final adapter: the run did not finish; `yeto export --state-dir "
              f"{out / 'syncer'} ...` exports its last merged weights)", file=stream)
    if run.cfg.backends:
        print("  islands/<id>/    adapter/, metrics.jsonl, summary.json, log.txt", file=stream)
    if run.external():
        print(f"  join.txt         the join commands (external islands, "
              f"{', '.join(i.id for i in run.external())}, keep their outputs on their own "
              "machines: --output there)", file=stream)
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
    args, rest = p.parse_known_args(argv)
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
