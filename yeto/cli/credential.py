"""`yeto credential ID...`: each island's own credential, from the run's token.

Run it where the run's token is (the syncer's machine: `$YETO_TOKEN` or --token-file),
and hand each island its own line privately: a credential is good for its own
learner id only, so a machine holding one can act as that island and no other. The
syncer derives credentials again from the token; it keeps no list.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from yeto import net


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto credential", description=__doc__.split("\n\n")[1],
        epilog="Example:  YETO_TOKEN=$(cat runs/wan/token) yeto credential island-1 island-2\n"
               "then on island-1's machine: export YETO_TOKEN=<its line>; python -m "
               "yeto.learner --learner-id island-1 ...",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("learner_ids", nargs="+", metavar="ID", help="the islands' --learner-id")
    p.add_argument("--token-file", type=Path, default=None,
                   help=f"read the run's token from this file (default: ${net.TOKEN_ENV})")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        token = args.token_file.read_text().strip() if args.token_file else \
            net.token_from_env(None)
    except OSError as e:
        print(f"error: cannot read --token-file {args.token_file}: {e.strerror}", file=sys.stderr)
        return 2
    if not token:
        print(f"error: no run token: set ${net.TOKEN_ENV} or pass --token-file",
              file=sys.stderr)
        return 2
    if net.credential_id(token) is not None:
        print("error: that is an island's credential, not the run's token", file=sys.stderr)
        return 2
    for learner in args.learner_ids:
        print(f"{learner}\t{net.island_credential(token, learner)}")
    return 0
