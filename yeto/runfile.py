"""The run file: one TOML file (``--config run.toml``) that the syncer, the islands,
the launcher, the sim and the RL programs all read, so one run's settings are
written once. Flags given on the command line win over the file; the file wins over
the defaults (which live in the config dataclasses the flags are built from).

    [run]                 # shared: every program takes the keys it has a flag for
    model = "runs/demo/model"
    data = "runs/demo/data/train.jsonl"
    quorum = 2            # the syncer
    num_learners = 2      # the islands' data shards
    sync_every = 20

    [syncer]              # python -m syncer / yeto syncer
    outer_lr = 0.7
    [island]              # the islands (torch and MLX), the sim and the GRPO island
    batch_size = 8
    [lora]                # r, alpha, targets, freeze_a: the --lora-* flags
    r = 8
    [data]                # seq_len, packing, eval_blocks, ...
    seq_len = 128

A key is a flag's name without the dashes (``sync_every`` for ``--sync-every``). A
key a program's section does not know is an error naming the file, the section and
the key (with the nearest known key); a ``[run]`` key is taken by the programs that
have it and must be known to one of them.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

# which sections each program reads, in order (later ones win)
ROLES = {
    "syncer": ("run", "syncer"),
    "island": ("run", "island", "lora", "data"),
    "sim": ("run", "syncer", "island", "lora", "data"),
    "rl": ("run", "island", "lora", "data", "rl"),
    "rollout": ("run", "lora", "rollout"),
    "launch": ("run", "launch"),
}
SECTIONS = ("run", "syncer", "island", "lora", "data", "rl", "rollout", "launch")
PREFIX = {"lora": "lora_"}  # [lora] r -> --lora-r
# what [run] may hold: the settings a run's programs share
RUN_KEYS = ("model", "data", "eval_data", "syncer", "quorum", "num_learners", "fragments",
            "downlink", "wire", "tuning", "sync_every", "sync_every_seconds", "max_steps",
            "seed", "seq_len", "state_dir", "out")

# sections several programs read: a key one of them lacks may be another's (an island
# setting the syncer or a rollout node does not use, a torch-only flag on MLX, a
# syncer flag the sim does not have)
TORCH_ONLY = ("device", "threads", "fsdp", "tuning")


# {role: a factory of that program's parser}: the programs a caller shares the file with
# (`yeto.config.island_parser` for the islands, the syncer's `build_parser`); this module
# knows no program's flags
Programs = Mapping[str, Callable[[], argparse.ArgumentParser]]


class RunFileError(ValueError):
    """The run file cannot be used (the message names the file, section and key)."""


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, metavar="RUN.toml",
                   help="read settings from a run file shared by the syncer and its islands "
                        "(sections [run], [syncer], [island], [lora], [data], [rl]); flags "
                        "given here win over it (docs/reference/run-file.md)")


@overload
def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, role: str,
          known: Literal[False] = False, *, programs: Programs) -> argparse.Namespace: ...


@overload
def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, role: str,
          known: Literal[True], *, programs: Programs) -> tuple[argparse.Namespace, list[str]]: ...


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, role: str, known: bool = False,
          *, programs: Programs) -> argparse.Namespace | tuple[argparse.Namespace, list[str]]:
    """`p.parse_args(argv)` (`parse_known_args` with `known`) with the run file's values
    (``--config``) as the defaults; a bad file is the parser's usage error (exit 2).
    `programs`: as for `values_for`."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    config = pre.parse_known_args(argv)[0].config
    if config is not None:
        try:
            p.set_defaults(**values_for(p, load(config), role, config, programs=programs))
        except RunFileError as e:
            p.error(str(e))
    return p.parse_known_args(argv) if known else p.parse_args(argv)


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The file's sections, checked to be known sections of plain values."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise RunFileError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise RunFileError(f"--config {path}: not UTF-8 text (byte {e.start}: "
                           f"{e.object[e.start:e.start + 1]!r}); TOML files are UTF-8: save "
                           "it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise RunFileError(f"--config {path}: not valid TOML: {e}") from None
    for name, section in data.items():
        if name not in SECTIONS or not isinstance(section, dict):
            raise RunFileError(f"--config {path}: [{name}] is not a section of a run file; "
                               f"the sections: {', '.join(SECTIONS)}")
    return data


def values_for(p: argparse.ArgumentParser, data: dict[str, dict[str, Any]], role: str,
               path: Path | str = "run.toml", *, programs: Programs) -> dict[str, Any]:
    """The defaults `role`'s parser takes from the file: {dest: value}, each value
    checked against its flag (type, choices, on/off flags given true or false). A key
    `p` lacks is skipped when one of `programs` reads that section and takes it."""
    actions = {a.dest: a for a in p._actions if a.option_strings}
    out = {}
    for section in ROLES[role]:
        for key, value in data.get(section, {}).items():
            dest = PREFIX.get(section, "") + key.replace("-", "_")
            if dest not in actions:
                if dest in _known_elsewhere(section, programs):
                    continue  # a shared setting another program takes
                known = RUN_KEYS if section == "run" else \
                    [d.removeprefix(PREFIX.get(section, "")) for d in actions]
                near = difflib.get_close_matches(key, known, n=1)
                raise RunFileError(f"--config {path}: [{section}] {key} is not a setting of "
                                   f"this program{f' (did you mean {near[0]!r}?)' if near else ''}")
            where = f"--config {path}: [{section}] {key}"
            action = actions[dest]
            if isinstance(action, argparse._AppendAction):  # a repeatable flag: a list
                out[dest] = [_checked(action, v, where)
                             for v in (value if isinstance(value, list) else [value])]
            else:
                out[dest] = _checked(action, value, where)
            action.required = False  # the file gives it
    return out


def _known_elsewhere(section: str, programs: Programs) -> set[str]:
    """The flag dests another program reading `section` takes: those of `programs`
    that read it, the torch island's own flags in the islands' sections, and the
    shared settings of [run]."""
    out = set()
    for role, parser in programs.items():
        if section in ROLES[role]:
            out |= _dests(parser())
    if section in ROLES["island"]:
        out |= set(TORCH_ONLY)
    if section == "run":
        out |= set(RUN_KEYS)
    return out


def _dests(p: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in p._actions if a.option_strings}


def _checked(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, (dict, list)) and not (isinstance(value, list) and
                                                all(isinstance(v, str) for v in value)):
        raise RunFileError(f"{where}: give a single value, not {type(value).__name__}")
    if isinstance(value, list):
        value = ",".join(value)  # a list of names: the flag's comma list
    if action.nargs == 0:  # an on/off flag
        if not isinstance(value, bool):
            raise RunFileError(f"{where} = {value!r}: give true or false")
        return value  # the key names the flag's dest: progress = false is --no-progress
    if isinstance(value, bool):
        raise RunFileError(f"{where} = {str(value).lower()}: give a value for "
                           f"{action.option_strings[0]}, not true/false")
    if action.type is not None:
        try:
            # typeshed's Action.type may be a registry name (str); these parsers give callables
            value = action.type(value if isinstance(value, str) else str(value))  # type: ignore[operator]
        except (TypeError, ValueError) as e:
            raise RunFileError(f"{where} = {value!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise RunFileError(f"{where} = {value!r}: choose one of "
                           f"{', '.join(map(str, action.choices))}")
    return value
