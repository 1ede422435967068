"""`yeto status HOST:PORT`: where a running syncer stands.

One Status call over gRPC (`yeto.client.status`): the run's round, version,
quorum, last merge, bytes received and sent, and per island its backend, state
(waiting | training | finished | gone), last contact, pushes and loss tokens. A run
served by shards (`yeto syncer --shard I/S`): list every shard's address in order,
separated by ';', for one line per shard and the islands over all of them.

    yeto status 127.0.0.1:29400
    yeto status 10.0.0.5:29400 --token $YETO_TOKEN --json
    yeto status 127.0.0.1:29400 --watch 2        # refresh every 2 s (Ctrl-C ends)
    yeto status '10.0.0.5:29400;10.0.0.6:29400'  # a run of two shards
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from yeto import net
from yeto.display import Screen, human_bytes, human_seconds, show, table, to_text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto status", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Show a running syncer's islands (state, last contact, pushes, tokens), "
                    "round, version, last merge and bytes on the wire.",
        epilog="Example: yeto status 127.0.0.1:29400 --json")
    p.add_argument("address", help="the syncer's HOST:PORT; a sharded run: every shard's, "
                                   "in order, separated by ';' ('A;B')")
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

    return status(address, token=token, tls=tls, timeout=timeout)


def view(s: dict, address: str = "") -> Group:
    """The status at a glance: the run's headline and a row per island."""
    state = "finished" if s.get("finished") else (
        "training" if s.get("round", 0) and any(i["state"] == "training" for i in s["islands"])
        else "waiting for islands")
    head = Text(f"syncer {address}  run {s.get('run_id', '?')}  {state}\n" + _figures(s))
    if s.get("problem"):
        head.append(f"\nnot committing: {s['problem']}", style="bold red")
    if s.get("shards", 0) > 1:
        head.append(f"\nshard {s.get('shard', 0)} of {s['shards']}: its fragments only; list "
                    "every shard's address in order ('A;B') for the whole run")
    return Group(head, Text(""), _islands(s["islands"]))


def _figures(s: dict) -> str:
    return (f"round {s.get('round', 0)}  version {s.get('version', 0)}  quorum "
            f"{s.get('quorum', 0)}  last merge {human_seconds(s.get('last_merge_s'))} ago  "
            f"bytes in {human_bytes(s.get('bytes_in'))}  out {human_bytes(s.get('bytes_out'))}")


def _islands(islands: list[dict]) -> Table | Text:
    if not islands:
        return Text("no islands have joined yet")
    rows = [[i["learner_id"], i.get("backend", "?"), i["state"],
             human_seconds(i.get("last_contact_s")) + " ago", str(i.get("pushes", 0)),
             str(i.get("loss_tokens", 0))]
            for i in sorted(islands, key=lambda i: i["learner_id"])]
    return table(["island", "backend", "state", "last contact", "pushes", "loss tokens"], rows,
                 right=(4, 5))


def view_shards(shards: list[dict], addresses: list[str]) -> Group:
    """A sharded run: a line per shard, then each island over all shards (its pushes
    and loss tokens summed, its newest contact, the state shard 0 holds)."""
    from yeto.client.connection import merged_islands

    lines = []
    for pos, (s, address) in enumerate(zip(shards, addresses)):
        line = Text(f"shard {s.get('shard', 0)}/{max(1, s.get('shards', 0))} {address}  "
                    + ("finished  " if s.get("finished") else "") + _figures(s))
        if s.get("shard", 0) != pos or max(1, s.get("shards", 0)) != len(shards):
            line.append(f"\n  expected shard {pos} of {len(shards)} here: list the shards "
                        "in order, each once", style="bold red")
        if s.get("problem"):
            line.append(f"\n  not committing: {s['problem']}", style="bold red")
        lines.append(line)
    return Group(*lines, Text(""), _islands(merged_islands(shards)))


def render(s: dict, address: str = "") -> str:
    """`view` as plain text."""
    return to_text(view(s, address))


def _tls(args):
    from yeto.client import TLSConfig

    try:
        files = net.client_tls_files(args.tls_ca, args.tls_cert, args.tls_key)
    except net.TLSFileError as e:
        sys.exit(f"error: {e}")
    return TLSConfig(*files) if files else None


def _fetch_or_say(args, address: str, tls) -> dict | int:
    """The status, or the exit code after saying what went wrong."""
    import grpc

    try:
        return fetch(address, args.token, tls, args.timeout)
    except grpc.RpcError as e:
        hint = {grpc.StatusCode.UNAUTHENTICATED: " (pass --token or set $YETO_TOKEN)",
                grpc.StatusCode.UNAVAILABLE: " (is the syncer running? check HOST:PORT)",
                }.get(e.code(), "")
        print(f"error: syncer {address}: {e.code().name}: {e.details()}{hint}",
              file=sys.stderr)
        return 1
    except ValueError as e:  # a malformed address
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tls = _tls(args)
    addresses = net.shard_entries(args.address)
    if not addresses:
        print("error: give the syncer's HOST:PORT (a sharded run: 'A;B')", file=sys.stderr)
        return 2
    screen = Screen("plain" if args.json or not args.watch else "auto")
    try:
        while True:
            got = [_fetch_or_say(args, a, tls) for a in addresses]
            failed = next((s for s in got if isinstance(s, int)), None)
            if failed is not None:
                return failed
            shards = [s for s in got if isinstance(s, dict)]
            if args.json:
                out = shards[0] if len(shards) == 1 else {"shards": [
                    dict(s, address=a) for s, a in zip(shards, addresses)]}
                print(json.dumps(out, indent=2, sort_keys=True), flush=True)
            else:
                shown = view(shards[0], addresses[0]) if len(shards) == 1 else \
                    view_shards(shards, addresses)
                if screen.mode == "live":
                    screen.show(shown)  # redrawn in place
                else:
                    show(shown)  # styled on a terminal, plain text elsewhere
            if not args.watch:
                return 0
            time.sleep(args.watch)
            if screen.mode != "live":
                print()
    except KeyboardInterrupt:
        return 0
    finally:
        screen.close()
