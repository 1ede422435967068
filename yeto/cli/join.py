"""External island slots of `yeto launch`: which address other machines dial, and the
command that joins a slot from another machine.

`yeto launch --external-islands N` reserves N slots the launcher does not start
itself (a Mac, a box behind a home uplink, a cloud VM): they count in the quorum
and in the data sharding, and for each one the launcher prints what to run on the
other machine:

    join island-2 (data shard 2 of 3) from another machine:
      # island-2's credential (...): typed or pasted, not echoed, not kept in the shell's history
      printf 'YETO_TOKEN: ' >&2; read -rs YETO_TOKEN; export YETO_TOKEN; echo >&2
      pip install "yeto[torch]"
      python -m yeto.learner --syncer 203.0.113.7:29400 --learner-id island-2 \\
          --learner-index 2 --num-learners 3 --model ... --data ... --output island-2

Each slot gets its own credential (`yeto.net.island_credential`: derived from the
run's token, good for that learner id only), written to ``OUT/credentials/<id>``
(mode 600): another machine never holds the run's token, so it can act only as its
own island. No secret appears in what is printed: the printed lines land in terminal
scroll-back, CI logs and ``tee`` files, and a secret on a command line is also
visible to every user of the other machine in ``ps``. The island reads its
credential from ``$YETO_TOKEN``; ``read -rs`` (bash and zsh alike) sets that
variable without echoing it or writing it to the shell's history. The run's token
itself was given to `yeto launch` (``--token`` / ``$YETO_TOKEN``), or the launcher
generated one and wrote it to a file only the user can read (``OUT/token``).

The address (`advertise_host`): ``--advertise-host`` when given; else the syncer's
``--host`` when that is a specific address; else, for a wildcard ``--host 0.0.0.0``
(or ``::``), this machine's own address: the source address of its default route
(found by connecting a UDP socket, which sends nothing), else the first non-loopback
IPv4 address of its interfaces, else what its host name resolves to. A loopback
``--host`` cannot be reached from another machine and is refused unless
``--advertise-host`` names a tunnel's address.
"""

from __future__ import annotations

import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from yeto import net
from yeto.backends import BACKENDS
from yeto.io import host_port, write_private

WILDCARDS = ("", "0.0.0.0", "::")
ROUTE_PROBE = "1.1.1.1"  # connect() on a UDP socket picks a route; no packet is sent


class JoinError(ValueError):
    """External slots that cannot work (the message says how to fix it)."""


def parse_slots(spec: str | None) -> list[str]:
    """``--external-islands``: ``N`` (any kind), ``torch:N``, ``mlx:N`` or a comma list
    of them; one entry per slot: "any", "torch" or "mlx"."""
    slots: list[str] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, _, count = part.rpartition(":")
        kind = kind or "any"
        if kind not in ("any", *BACKENDS) or not count.isdigit():
            raise JoinError(f"--external-islands {spec!r}: use N, torch:N, mlx:N or a comma "
                            "list of them, e.g. --external-islands mlx:1,torch:2")
        slots += [kind] * int(count)
    return slots


def advertise_host(host: str, given: str | None = None) -> str:
    """The address other machines dial to reach a syncer listening on `host` (see the
    module's docstring for the rule)."""
    if given:
        return given
    if net.is_loopback(host):
        raise JoinError(f"--host {host} is reachable only from this machine, so no other "
                        "machine can join: listen on all interfaces with --host 0.0.0.0 (or "
                        "this machine's address), or pass --advertise-host with the address "
                        "of a tunnel (ssh -R) that reaches this port")
    if host not in WILDCARDS:
        return host
    found = route_address() or interface_address() or hostname_address()
    if not found:
        raise JoinError("could not find an address of this machine that other machines can "
                        "reach: pass it with --advertise-host, e.g. --advertise-host "
                        "203.0.113.7 (or a DNS name)")
    return found


def route_address() -> str | None:
    """The source address of the default route (None without one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ROUTE_PROBE, 9))
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if net.is_loopback(addr) or addr == "0.0.0.0" else addr


def interface_address() -> str | None:
    """The first non-loopback IPv4 address of this machine's interfaces (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue  # no IPv4 address on this interface
            if not net.is_loopback(addr):
                return addr
    return None


def hostname_address() -> str | None:
    try:
        addrs = socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return None
    return next((a for a in addrs if not net.is_loopback(a)), None)


@dataclass
class JoinSpec:
    """What every external slot's command shares."""

    address: str                     # HOST:PORT other machines dial
    model: str
    data: str
    num_learners: int
    eval_data: str | None = None
    island_args: list[str] = field(default_factory=list)
    backend_args: dict[str, list[str]] = field(default_factory=dict)
    tls_ca: Path | None = None
    # where the user finds the slot's credential ("{id}": its learner id); None: no token
    token_hint: str | None = None


def join_address(host: str, port: int, given: str | None = None) -> str:
    return host_port(advertise_host(host, given), port)


def write_credential(out: Path, token: str, learner_id: str) -> Path:
    """OUT/credentials/<id>: the slot's own credential (good for that id only; the run's
    token stays on this machine), readable by this user only."""
    folder = out / "credentials"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / learner_id
    write_private(path, net.island_credential(token, learner_id) + "\n")
    return path


def credential_hint(out: Path) -> str:
    """Where a slot's user finds its credential ("{id}": the slot's learner id)."""
    return (f"in {out / 'credentials'}/{{id}} on this machine, made from the run's token; "
            "good for {id} only")


def island_argv(spec: JoinSpec, backend: str, learner_id: str, index: int) -> list[str]:
    """The island program and flags for one slot (no secret among them)."""
    argv = ["python", "-m", BACKENDS[backend].module, "--syncer", spec.address,
            "--learner-id", learner_id, "--learner-index", str(index),
            "--num-learners", str(spec.num_learners), "--model", spec.model, "--data", spec.data]
    if spec.eval_data:
        argv += ["--eval-data", spec.eval_data]
    if spec.tls_ca is not None:
        argv += ["--tls-ca", str(spec.tls_ca)]
    return argv + ["--output", learner_id, *spec.island_args,
                   *spec.backend_args.get(backend, [])]


def join_block(spec: JoinSpec, kind: str, learner_id: str, index: int) -> list[str]:
    """What to run on the other machine for one slot: a heading, then shell lines
    (indented two spaces; comments start with #). Running the indented lines in
    order, in bash or zsh, joins the slot ("any": a torch island; the MLX
    alternative is shown as a comment)."""
    backend = "torch" if kind == "any" else kind
    lines = [f"join {learner_id} (data shard {index} of {spec.num_learners}"
             f"{'' if kind == 'any' else ', ' + kind}) from another machine:"]
    if spec.token_hint:
        lines += [f"  # {learner_id}'s credential ({spec.token_hint.format(id=learner_id)}): "
                  "typed or pasted, not echoed, not kept in the shell's history",
                  f"  printf '{net.TOKEN_ENV}: ' >&2; read -rs {net.TOKEN_ENV}; "
                  f"export {net.TOKEN_ENV}; echo >&2"]
    if spec.tls_ca is not None:
        lines.append(f"  # TLS: copy {spec.tls_ca} (the syncer's certificate or its CA: public, "
                     "not a secret) to the same path on that machine")
    config = next((b for a, b in zip(spec.island_args, spec.island_args[1:])
                   if a == "--config"), None)  # the run file: the same settings there
    local = [p for p in (config, spec.model, spec.data, spec.eval_data)
             if p and Path(p).exists()]
    if local:
        lines.append(f"  # {', '.join(local)}: paths on this machine; the other machine needs "
                     "the same files there (or use hub ids)")
    if kind == "any":
        lines.append(f"  # {BACKENDS['torch'].where}:")
    lines += [f"  {BACKENDS[backend].install}",
              "  " + shlex.join(island_argv(spec, backend, learner_id, index))]
    if kind == "any":
        lines += [f"  # or {BACKENDS['mlx'].where}:",
                  f"  #   {BACKENDS['mlx'].install}",
                  "  #   " + shlex.join(island_argv(spec, "mlx", learner_id, index))]
    return lines


def shell_lines(block: list[str]) -> list[str]:
    """The lines of a `join_block` to run, as printed (comments and heading left out)."""
    return [line[2:] for line in block
            if line.startswith("  ") and not line.lstrip().startswith("#")]
