"""A network lab on one Linux machine: hosts as network namespaces on one switch.

Every host is a network namespace with its own stack and one interface, ``eth0``,
cabled by a veth pair to a bridge that lives in the lab's own switch namespace:

    host a (192.0.2.1) --eth0==va--+
    host b (192.0.2.2) --eth0==vb--+-- br0   (namespace <lab>-sw)
    host c (192.0.2.3) --eth0==vc--+

Addresses come from a documentation range (192.0.2.0/24 by default) and exist
only inside the lab's namespaces, which have no other interface and no default
route: their traffic cannot leave the machine, and nothing in the root namespace
takes part (processes run *inside* a host with `Lab.popen` / `Lab.run`, i.e.
``ip netns exec <ns> ...``). Per host, optionally:

- a bandwidth limit (`Lab.limit`): ``tc qdisc tbf`` on both ends of its cable,
  so uplink and downlink are both limited;
- latency through a user-space TCP relay (`Lab.relay`; the kernel's netem module
  is not available everywhere): the relay runs in the host, listens on its
  loopback, and holds each chunk ``delay_ms`` before passing it on;
- a cut (`Lab.down` / `Lab.up`, or ``with lab.cut(host):``): the cable goes down
  and comes back, as a Wi-Fi drop would; ``reset=True`` also aborts the host's open
  connections (``ss -K``), as a laptop that comes back on another network sees.

    with Lab() as lab:                       # names unique to this run
        a, b = lab.host("a"), lab.host("b", rate_mbit=20)
        syncer = lab.popen(a, ["python", "-m", "syncer", "--host", a.addr, ...])
        lab.run(b, ["python", "-m", "yeto.learner", "--syncer", f"{a.addr}:29400", ...])
    # leaving the block kills every process started in the lab and deletes its
    # namespaces (and so its cables), even when the body raised

Needs root and iproute2 (`ip`; `tc` for limits); `unavailable()` says why not.
As a program: ``python -m yeto.testing.netlab check`` says whether the lab runs here;
``python -m yeto.testing.netlab relay --listen 127.0.0.1:9000 --to 192.0.2.1:29400
--delay-ms 20`` is the relay (started by `Lab.relay` inside a host).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "ylab"               # every namespace of a lab: ylab-<pid>-<hex>-<host>
SUBNET = "192.0.2.0/24"       # TEST-NET-1 (RFC 5737): documentation only, never routed
IFACE = "eth0"                # a host's one interface
ROOT = Path(__file__).resolve().parents[2]  # holds yeto and syncer: the processes' cwd


class LabError(RuntimeError):
    """A lab command failed (the message has the command and its output)."""


def unavailable() -> str | None:
    """None when labs can be built here, else the reason (for ``pytest.skip``)."""
    if sys.platform != "linux":
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, veth, bridge); run the tests as root"
    if shutil.which("ip") is None:
        return "the network lab needs iproute2's `ip` (apt-get install iproute2)"
    return _probe()


_PROBED: list[str | None] = []


def _probe() -> str | None:
    """Build and delete a one-bridge namespace once (some containers forbid it)."""
    if not _PROBED:
        ns = f"{PREFIX}-{os.getpid()}-probe"
        try:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "add", "br0", "type", "bridge")
            _PROBED.append(None)
        except LabError as e:
            _PROBED.append(f"network namespaces or bridges are not permitted here: {e}")
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return _PROBED[0]


def tc_unavailable() -> str | None:
    """None when bandwidth limits work (`tc` and the tbf qdisc), else why not."""
    if shutil.which("tc") is None:
        return "bandwidth limits need iproute2's `tc`"
    return None


def _ip(*args: str) -> str:
    return _cmd(["ip", *args])


def _cmd(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: {(r.stderr or r.stdout).strip()}")
    return r.stdout


@dataclass
class Host:
    """One machine of the lab: a namespace, its address and its switch port."""

    name: str
    ns: str
    addr: str
    port: str                   # the cable's far end, in the switch namespace
    rate_mbit: float | None = None

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Lab:
    """Hosts on one switch; a context manager that removes everything it made."""

    subnet: str = SUBNET
    tag: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(2)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self):
        why = unavailable()
        if why:
            raise LabError(why)
        self.net = ipaddress.ip_network(self.subnet)
        self.switch = f"{PREFIX}-{self.tag}-sw"
        self._made: list[str] = []
        reap_stale()
        self._netns_add(self.switch)
        _ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "dev", "br0", "up")

    def _netns_add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "dev", "lo", "up")

    # ---- hosts and cables ----------------------------------------------------------
    def host(self, name: str, rate_mbit: float | None = None) -> Host:
        """A new host on the switch, addressed in order (.1, .2, ...)."""
        if name in self.hosts or not name.isalnum() or len(name) > 12:
            raise ValueError(f"host name {name!r}: use a new short alphanumeric name")
        addr = str(self.net.network_address + len(self.hosts) + 1)
        h = Host(name, f"{PREFIX}-{self.tag}-{name}", addr, port=f"v{name}")
        self._netns_add(h.ns)
        _ip("-n", self.switch, "link", "add", "name", h.port, "type", "veth",
            "peer", "name", IFACE, "netns", h.ns)
        _ip("-n", self.switch, "link", "set", "dev", h.port, "master", "br0", "up")
        _ip("-n", h.ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", IFACE)
        _ip("-n", h.ns, "link", "set", "dev", IFACE, "up")
        self.hosts[name] = h
        if rate_mbit:
            self.limit(h, rate_mbit)
        return h

    def limit(self, host: Host, rate_mbit: float | None) -> None:
        """Limit the host's cable to `rate_mbit` each way (tbf); None removes it."""
        ends = ((host.ns, IFACE), (self.switch, host.port))
        for ns, dev in ends:
            if rate_mbit is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True)
                continue
            burst = max(16_000, int(rate_mbit * 1e6 / 8 / 100))  # ~10 ms of traffic
            _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                  "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"])
        host.rate_mbit = rate_mbit

    def down(self, host: Host, reset: bool = False) -> None:
        """Cut the host's cable (no carrier, as when Wi-Fi drops). Open TCP connections
        survive a short cut (they stall, then resume); with `reset` the host's
        connections to the lab are also aborted (`ss -K`), as when a laptop comes back
        on another network or a NAT forgets its mapping."""
        _ip("-n", self.switch, "link", "set", "dev", host.port, "down")
        if reset:
            _cmd([*host.exec_prefix(), "ss", "-K", "-t", "dst", str(self.net)])

    def up(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", "dev", host.port, "up")

    @contextlib.contextmanager
    def cut(self, host: Host, reset: bool = False):
        """The host is offline inside the block (see `down` for `reset`)."""
        self.down(host, reset)
        try:
            yield host
        finally:
            self.up(host)

    # ---- processes -----------------------------------------------------------------
    def popen(self, host: Host, cmd: list[str], **kw) -> subprocess.Popen:
        """Start `cmd` inside `host` (own session; killed by `close`). Keyword
        arguments go to `subprocess.Popen` (cwd defaults to the folder holding yeto)."""
        kw.setdefault("cwd", ROOT)
        proc = subprocess.Popen([*host.exec_prefix(), *map(str, cmd)],
                                start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, cmd: list[str], timeout: float = 300, input: str | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run `cmd` inside `host` to the end; its output is captured as text, `input`
        goes to its stdin."""
        proc = self.popen(host, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          text=True, **kw)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def relay(self, host: Host, target: str, delay_ms: float, listen_port: int = 0,
              ready_timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
        """A TCP relay inside `host` on its loopback that forwards to `target`
        (HOST:PORT) holding every chunk `delay_ms` each way. Returns (process,
        the loopback address to dial instead of `target`)."""
        port_file = Path(f"/tmp/{host.ns}-relay-{secrets.token_hex(3)}")
        proc = self.popen(host, [sys.executable, "-m", "yeto.testing.netlab", "relay",
                                 "--listen", f"127.0.0.1:{listen_port}", "--to", target,
                                 "--delay-ms", str(delay_ms), "--port-file", str(port_file)])
        deadline = time.monotonic() + ready_timeout
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"the relay in {host.name} did not start (code {proc.poll()})")
            time.sleep(0.02)
        port = port_file.read_text().strip()
        port_file.unlink()
        return proc, f"127.0.0.1:{port}"

    def kill(self, proc: subprocess.Popen, grace_s: float = 5.0) -> None:
        """SIGTERM to the process's group, SIGKILL after `grace_s`."""
        if proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # ---- teardown ------------------------------------------------------------------
    def close(self) -> None:
        """Kill what the lab started (its processes, then anything still inside its
        namespaces), then delete the namespaces (their cables go with them)."""
        for proc in self.procs:
            self.kill(proc, grace_s=2.0)
        for ns in reversed(self._made):
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still in namespace `ns` (the lab started them all)."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def reap_stale() -> list[str]:
    """Delete lab namespaces left by a lab whose process is gone (a killed test run)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    gone = []
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and \
                not Path(f"/proc/{parts[1]}").exists():
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            gone.append(ns)
    return gone


# ---- TLS for lab syncers -----------------------------------------------------------
def make_cert(out_dir: Path, ips: list[str], name: str = "yeto-lab") -> tuple[Path, Path]:
    """A self-signed server certificate for `ips` (also usable as the islands' CA):
    with the `cryptography` package when installed, else the `openssl` command."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cert, key = out_dir / "server.pem", out_dir / "server.key"
    try:
        _cert_cryptography(cert, key, ips, name)
    except ImportError:
        if shutil.which("openssl") is None:
            raise LabError("TLS certificates need the `cryptography` package or the `openssl` "
                           "command") from None
        san = ",".join(f"IP:{ip}" for ip in ips)
        _cmd(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
              "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", f"/CN={name}",
              "-addext", f"subjectAltName={san}", "-keyout", str(key), "-out", str(cert)])
    key.chmod(0o600)
    return cert, key


def _cert_cryptography(cert: Path, key: Path, ips: list[str], name: str) -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    k = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
         .public_key(k.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.SubjectAlternativeName(
             [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]), critical=False)
         .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
         .sign(k, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))


# ---- the relay (runs inside a host) --------------------------------------------------
async def _relay_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      delay_s: float) -> None:
    """Copy reader -> writer, each chunk held `delay_s`; a bounded queue keeps TCP's
    back-pressure (a slow far side slows the near one)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=64)

    async def pump_in():
        while True:
            data = await reader.read(65536)
            await queue.put((loop.time() + delay_s, data))
            if not data:
                return

    feeder = asyncio.ensure_future(pump_in())
    try:
        while True:
            due, data = await queue.get()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        feeder.cancel()


async def _relay_main(listen: str, target: str, delay_s: float, port_file: Path | None) -> None:
    lhost, _, lport = listen.rpartition(":")
    thost, _, tport = target.rpartition(":")

    async def handle(r_in, w_in):
        try:
            r_out, w_out = await asyncio.open_connection(thost, int(tport))
        except OSError:
            w_in.close()
            return
        await asyncio.gather(_relay_pipe(r_in, w_out, delay_s), _relay_pipe(r_out, w_in, delay_s),
                             return_exceptions=True)
        for w in (w_in, w_out):
            w.close()

    server = await asyncio.start_server(handle, lhost, int(lport))
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(server.sockets[0].getsockname()[1]))
        tmp.rename(port_file)
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m yeto.testing.netlab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether the lab can run here")
    r = sub.add_parser("relay", help="a TCP relay that adds latency (run inside a host)")
    r.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any)")
    r.add_argument("--to", required=True, help="HOST:PORT to forward to")
    r.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    r.add_argument("--port-file", type=Path, default=None, help="write the bound port here")
    args = p.parse_args(argv)
    if args.cmd == "check":
        why = unavailable()
        print(why or "the network lab can run here")
        return 1 if why else 0
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_relay_main(args.listen, args.to, args.delay_ms / 1000, args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
