"""`yeto status HOST:PORT`: where a running syncer stands.

One Status call over gRPC (`yeto.client.status`): the run's round, version,
quorum, last merge, bytes received and sent, and per island its backend, state
(waiting | training | finished | gone), last contact, pushes and loss tokens.

    yeto status 127.0.0.1:29400
    yeto status 10.0.0.5:29400 --token $YETO_TOKEN --json
    yeto status 127.0.0.1:29400 --watch 2        # refresh every 2 s (Ctrl-C ends)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Group
from rich.text import Text

from yeto.display import Screen, human_bytes, human_seconds, show, table, to_text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto status", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Show a running syncer's islands (state, last contact, pushes, tokens), "
                    "round, version, last merge and bytes on the wire.",
        epilog="Example: yeto status 127.0.0.1:29400 --json")
    p.add_argument("address", help="the syncer's HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("--token", default=None, help="the syncer's token (default: $YETO_TOKEN)")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="CA of the syncer's certificate (a TLS syncer)")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="client key (mutual TLS)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the reply")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C (0 = once)")
    return p


def fetch(address: str, token: str | None = None, tls=None, timeout: float = 10.0) -> dict:
    """The syncer's status as a plain dict (numbers as numbers)."""
    from yeto.client import status

    s = status(address, token=token, tls=tls, timeout=timeout)
    return normalize(s)


def normalize(s: dict) -> dict:
    """protobuf's JSON mapping writes 64-bit integers as strings: make them ints."""
    ints = ("round", "version", "quorum", "bytes_in", "bytes_out", "pushes", "loss_tokens",
            "generation")
    out = {k: (int(v) if k in ints and isinstance(v, str) else v) for k, v in s.items()}
    out["islands"] = [normalize(i) for i in s.get("islands", [])]
    return out


def view(s: dict, address: str = "") -> Group:
    """The status at a glance: the run's headline and a row per island."""
    state = "finished" if s.get("finished") else (
        "training" if s.get("round", 0) and any(i["state"] == "training" for i in s["islands"])
        else "waiting for islands")
    head = Text(f"syncer {address}  run {s.get('run_id', '?')}  {state}\n"
                f"round {s.get('round', 0)}  version {s.get('version', 0)}  quorum "
                f"{s.get('quorum', 0)}  last merge {human_seconds(s.get('last_merge_s'))} ago  "
                f"bytes in {human_bytes(s.get('bytes_in'))}  out "
                f"{human_bytes(s.get('bytes_out'))}")
    if s.get("problem"):
        head.append(f"\nnot committing: {s['problem']}", style="bold red")
    if not s["islands"]:
        return Group(head, Text("no islands have joined yet"))
    rows = [[i["learner_id"], i.get("backend", "?"), i["state"],
             human_seconds(i.get("last_contact_s")) + " ago", str(i.get("pushes", 0)),
             str(i.get("loss_tokens", 0))]
            for i in sorted(s["islands"], key=lambda i: i["learner_id"])]
    return Group(head, Text(""), table(["island", "backend", "state", "last contact", "pushes",
                                        "loss tokens"], rows, right=(4, 5)))


def render(s: dict, address: str = "") -> str:
    """`view` as plain text."""
    return to_text(view(s, address))


def _tls(args):
    from yeto import net
    from yeto.client import TLSConfig

    try:
        files = net.client_tls_files(args.tls_ca, args.tls_cert, args.tls_key)
    except net.TLSFileError as e:
        sys.exit(f"error: {e}")
    return TLSConfig(*files) if files else None


def _fetch_or_say(args, tls) -> dict | int:
    """The status, or the exit code after saying what went wrong."""
    import grpc

    try:
        return fetch(args.address, args.token, tls, args.timeout)
    except grpc.RpcError as e:
        hint = {grpc.StatusCode.UNAUTHENTICATED: " (pass --token or set $YETO_TOKEN)",
                grpc.StatusCode.UNAVAILABLE: " (is the syncer running? check HOST:PORT)",
                }.get(e.code(), "")
        print(f"error: syncer {args.address}: {e.code().name}: {e.details()}{hint}",
              file=sys.stderr)
        return 1
    except ValueError as e:  # a malformed address
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tls = _tls(args)
    screen = Screen("plain" if args.json or not args.watch else "auto")
    try:
        while True:
            s = _fetch_or_say(args, tls)
            if isinstance(s, int):
                return s
            if args.json:
                print(json.dumps(s, indent=2, sort_keys=True), flush=True)
            elif screen.mode == "live":
                screen.show(view(s, args.address))  # redrawn in place
            else:
                show(view(s, args.address))  # styled on a terminal, plain text elsewhere
            if not args.watch:
                return 0
            time.sleep(args.watch)
            if screen.mode != "live":
                print()
    except KeyboardInterrupt:
        return 0
    finally:
        screen.close()
