"""Start a syncer subprocess (`python -m syncer`) and learn its address: one place for it.

    from syncer.spawn import start_syncer

    with start_syncer(["--quorum", "2", "--state-dir", "runs/s"], cwd=ROOT) as syncer:
        run_islands(syncer.address)            # e.g. "127.0.0.1:40123"
    # leaving the block stops it: SIGTERM (it saves state every round), then SIGKILL

`start_syncer` adds ``--host``, ``--port`` (0: any free port) and ``--port-file`` to the
arguments and returns once the syncer has written the port file, i.e. once it
listens. If the process exits first, or does not listen within ``timeout_s``, it
raises `SyncerStartError` with the end of the syncer's output. The wait polls the
port file while waiting on the process itself, so it returns as soon as either
happens: no fixed sleeps.

Its output goes to ``log`` (a path, or an open file that the caller keeps owning);
without one it goes to a temporary file, quoted on failure and removed by `stop`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from yeto.io import host_port

__all__ = ["SyncerProcess", "SyncerStartError", "start_syncer"]

OWN_FLAGS = ("--host", "--port", "--port-file", "--dashboard-port", "--dashboard-port-file")


class SyncerStartError(RuntimeError):
    """The syncer exited before it listened, or did not listen in time (the message
    carries the end of its output)."""


class SyncerProcess:
    """A running `python -m syncer`: its process, port and address; a context manager
    that stops it on exit."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, log_path: Path | None,
                 owned: list[IO[Any]], tmpdir: Path | None):
        self.proc = proc
        self.host = host                   # the host islands connect to
        self.port: int = 0
        self.dashboard_port: int | None = None
        self.log_path = log_path
        self._owned = owned                # files this object opened (closed by stop)
        self._tmpdir = tmpdir              # removed by stop

    @property
    def address(self) -> str:
        """HOST:PORT for islands (``[::1]:PORT`` for IPv6 hosts)."""
        return host_port(self.host, self.port)

    @property
    def dashboard_url(self) -> str | None:
        if self.dashboard_port is None:
            return None
        return f"http://{host_port('127.0.0.1', self.dashboard_port)}/"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    def send_signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass

    def tail(self, lines: int = 20) -> str:
        """The last lines of the syncer's output ('' when there is no log to read)."""
        if self.log_path is None:
            return ""
        for f in self._owned:
            f.flush()
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self, grace_s: float = 0.0, term_timeout_s: float = 15.0) -> int | None:
        """Give the syncer ``grace_s`` to exit by itself (it does once a run finished and
        the final weights went out), then SIGTERM, then SIGKILL after ``term_timeout_s``.
        Returns its exit code. Safe to call more than once."""
        code = None
        try:
            code = self.proc.wait(timeout=grace_s) if grace_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            pass
        if code is None:
            self.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=term_timeout_s)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                code = self.proc.wait()
        self.close()
        return code

    def kill(self) -> None:
        """SIGKILL at once (a crash, as fault tests want it)."""
        if self.proc.poll() is None:
            self.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.close()

    def close(self) -> None:
        """Close the log file this object opened and remove its temp folder (the process
        is left as it is)."""
        for f in self._owned:
            f.close()
        self._owned = []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> SyncerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def connect_host(host: str) -> str:
    """Where to reach a syncer bound to `host`: wildcard binds are reached on loopback."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def start_syncer(args: Sequence[str] = (), *, host: str = "127.0.0.1", port: int = 0,
                 port_file: str | Path | None = None, dashboard_port: int | None = None,
                 cwd: str | Path | None = None, env: Mapping[str, str] | None = None,
                 log: str | Path | IO[Any] | None = None, timeout_s: float = 60.0,
                 new_session: bool = False, python: str = sys.executable) -> SyncerProcess:
    """Start ``python -m syncer ARGS`` listening on ``host:port`` and wait until it listens.

    args: further syncer flags (``python -m syncer --help``), e.g. ``["--quorum", "2"]``;
      the flags this function sets (``--host``, ``--port``, ``--port-file``, and with
      ``dashboard_port`` the dashboard's) are refused here.
    port_file: where the syncer writes its port (default: a temp file).
    dashboard_port: also serve the dashboard (0 = any free port); see ``dashboard_url``.
    log: a path, or an open file, for the syncer's stdout and stderr (default: a temp
      file); new_session: start it in its own session, so a terminal's Ctrl-C does not
      reach it.
    Raises SyncerStartError (with the end of its output) when it exits before it listens
    or does not listen within ``timeout_s``.
    """
    taken = [a for a in args if a.split("=")[0] in OWN_FLAGS]
    if taken:
        raise ValueError(f"{', '.join(taken)}: pass host=, port=, port_file=, dashboard_port= "
                         "to start_syncer instead")
    tmpdir = Path(tempfile.mkdtemp(prefix="yeto-syncer-")) if port_file is None or log is None \
        else None
    if port_file is None:
        assert tmpdir is not None  # made just above when no port file is given
        port_file = tmpdir / "port"
    port_file = Path(port_file)
    dash_file = port_file.with_name(port_file.name + "-dashboard")
    for f in (port_file, dash_file):
        f.unlink(missing_ok=True)  # a stale file from an earlier run must not count
    cmd = [python, "-m", "syncer", "--host", host, "--port", str(port),
           "--port-file", str(port_file), *args]
    if dashboard_port is not None:
        cmd += ["--dashboard-port", str(dashboard_port), "--dashboard-port-file", str(dash_file)]
    out, owned, log_path = _open_log(log, tmpdir)
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(env) if env is not None else None,
                                start_new_session=new_session)
    except BaseException:
        for opened in owned:
            opened.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    syncer = SyncerProcess(proc, connect_host(host), log_path, owned, tmpdir)
    try:
        syncer.port = _wait_for_port(syncer, port_file, timeout_s)
    except BaseException:
        syncer.kill()
        raise
    if dash_file.exists():  # written before the port file
        syncer.dashboard_port = int(dash_file.read_text())
    return syncer


def _open_log(log: str | Path | IO[Any] | None, tmpdir: Path | None
              ) -> tuple[IO[Any], list[IO[Any]], Path | None]:
    if log is None:
        assert tmpdir is not None  # start_syncer makes one when no log is given
        log = tmpdir / "log.txt"
    if isinstance(log, (str, Path)):
        f = open(log, "w")  # noqa: SIM115 - closed by SyncerProcess.close
        return f, [f], Path(log)
    name = getattr(log, "name", None)
    return log, [], Path(name) if isinstance(name, str) and os.path.exists(name) else None


def _wait_for_port(syncer: SyncerProcess, port_file: Path, timeout_s: float) -> int:
    """Wait for the port file (written atomically once the syncer listens) or the
    process's exit, whichever comes first."""
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        left = deadline - time.monotonic()
        if left <= 0:
            raise SyncerStartError(f"the syncer did not listen within {timeout_s:.0f} s; its "
                                   f"output:\n{syncer.tail() or '(none)'}")
        try:
            code = syncer.proc.wait(timeout=min(0.05, left))
        except subprocess.TimeoutExpired:
            continue
        if port_file.exists():  # it listened, then exited at once: report the exit below
            break
        raise SyncerStartError(f"the syncer exited with code {code} before it listened; its "
                               f"output:\n{syncer.tail() or '(none)'}")
    return int(port_file.read_text())
