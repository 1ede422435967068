"""An island's settings: one typed `IslandConfig`, the same for torch and MLX.

The library takes an `IslandConfig`; `argparse` stops at the command-line edge
(`add_island_args` + `IslandConfig.from_args`). Every flag of
`python -m yeto.learner` / `python -m yeto.mlx.learner` is a field here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from yeto import codec, net, runfile
from yeto.data import PACKING
from yeto.targets import TARGET_MODES

EXAMPLE = ("--model runs/demo/model --data runs/demo/data/train.jsonl "
           "--syncer 127.0.0.1:29400")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with defaults shown and examples kept as written."""


class ConfigError(ValueError):
    """An island setting that cannot work; the message says which and how to fix it."""


@dataclass
class IslandConfig:
    """Everything an island needs to know; field names are the flags' names."""

    model: str = ""
    data: str = ""
    model_revision: str | None = None
    trust_remote_code: bool = False
    data_revision: str | None = None
    data_split: str | None = None
    eval_data: str | None = None
    eval_data_revision: str | None = None
    eval_split: str | None = None
    packing: str = "document"
    syncer: str | None = None          # host:port; None trains a single island
    allow_solo: bool = False           # finish with success even if no round was joined
    learner_id: str = "island-0"
    learner_index: int | None = None   # None: the number at the end of learner_id
    num_learners: int = 1
    tuning: str = "lora"
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_freeze_a: bool = False
    lora_targets: str = "auto"
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    inner_lr: float = 1e-3
    weight_decay: float = 0.0
    sync_every: int = 50
    wire: str = "q4"
    sync_every_seconds: float = 0.0
    merge_alpha: float = 0.0
    pipeline: int = 1
    slowdown: float = 1.0
    blocking_sync: bool = False
    max_steps: int = 200
    eval_blocks: int = 64
    output: Path | None = None
    seed: int = 0
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    keepalive_s: float = net.KEEPALIVE_S
    progress: bool = True
    log_level: str = "INFO"
    device: str = "auto"               # torch: auto | cpu | cuda | cuda:N
    threads: int = 0                   # torch CPU threads (0 = torch's default)
    fsdp: bool = False                 # torch under torchrun: shard the model (FSDP2)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> IslandConfig:
        """The config of parsed `add_island_args` flags (unknown attributes ignored)."""
        given = vars(args)
        fields = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in given.items() if k in fields})
        cfg.progress = not given.get("no_progress", False)
        if cfg.syncer in ("none", ""):
            cfg.syncer = None
        return cfg

    @property
    def shard(self) -> tuple[int, int]:
        return self.resolved_index(), self.num_learners

    def resolved_index(self) -> int:
        if self.learner_index is not None:
            return self.learner_index
        tail = self.learner_id[len(self.learner_id.rstrip("0123456789")):]
        return int(tail) if tail else 0

    def check(self) -> IslandConfig:
        """Raise `ConfigError` for settings that cannot work (no model needed)."""
        if not self.model:
            raise ConfigError(f"--model is required (example: {EXAMPLE}); "
                              "`yeto make-tiny-model DIR` builds a tiny local one")
        if not self.data:
            raise ConfigError(f"--data is required (example: {EXAMPLE}); "
                              "`yeto make-task DIR` writes a small task")
        for name in ("num_learners", "lora_r", "seq_len", "batch_size", "grad_accum",
                     "sync_every", "max_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        self.learner_index = self.resolved_index()
        if not 0 <= self.learner_index < self.num_learners:
            raise ConfigError(f"learner index {self.learner_index} is outside "
                              f"0..{self.num_learners - 1}; set --learner-index or "
                              "--num-learners")
        if not 0.0 <= self.merge_alpha < 1.0:
            raise ConfigError("--merge-alpha must be in [0, 1)")
        if self.keepalive_s < 1:
            raise ConfigError("--keepalive-s must be at least 1 (seconds)")
        try:  # checked before the model loads: gRPC would fail only at the first handshake
            net.client_tls_files(self.tls_ca, self.tls_cert, self.tls_key)
        except net.TLSFileError as e:
            raise ConfigError(str(e)) from None
        return self


D = IslandConfig  # every island flag's default is the field's


def add_island_args(p: argparse.ArgumentParser) -> None:
    """The flags both islands take (each backend adds its own few)."""
    _add_model_and_data(p)
    _add_run(p)
    _add_training(p)
    _add_sync(p)
    _add_security_and_output(p)
    runfile.add_config_arg(p)


def island_parser() -> argparse.ArgumentParser:
    """A parser of the flags both islands take: what the other programs reading a run
    file know the islands' settings by (`yeto.runfile`'s `programs`)."""
    p = argparse.ArgumentParser(add_help=False)
    add_island_args(p)
    return p


def _add_model_and_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face model dir or hub id (required)")
    p.add_argument("--model-revision", default=D.model_revision,
                   help="branch, tag or commit of a hub --model (default main), pinned to its "
                        "commit before training; local dirs are pinned by a content digest")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow code shipped in the model repo (auto_map) to run; off by default")
    p.add_argument("--data", help="training data: a .jsonl/.json/.parquet file, a folder of them, "
                                  "a datasets save_to_disk folder or a hub dataset id; rows are "
                                  "text | messages | conversations (ShareGPT) | Alpaca | "
                                  "prompt/completion (see `yeto data --help`)")
    p.add_argument("--data-revision", default=D.data_revision,
                   help="branch, tag or commit of a hub --data (default main), pinned to a commit")
    p.add_argument("--data-split", default=D.data_split,
                   help="split of a folder / hub / saved dataset --data (default train)")
    p.add_argument("--eval-data", default=D.eval_data,
                   help="held-out data (same kinds as --data), evaluated at every sync")
    p.add_argument("--eval-data-revision", default=D.eval_data_revision,
                   help="as --data-revision, for --eval-data")
    p.add_argument("--eval-split", default=D.eval_split,
                   help="split of --eval-data (default validation, else test)")
    p.add_argument("--packing", choices=PACKING, default=D.packing,
                   help="document: packed rows never attend to each other (block-diagonal "
                        "mask, positions restart per row); naive: plain causal blocks")


def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--syncer", default="none",
                   help="syncer host:port, or 'none' to train as a single island")
    p.add_argument("--allow-solo", action="store_true",
                   help="exit 0 even if the syncer was never reached (the island then trained "
                        "alone); without it, an island that joined no round exits 3")
    p.add_argument("--learner-id", default=D.learner_id, help="this island's name in the run")
    p.add_argument("--learner-index", type=int, default=D.learner_index,
                   help="which data shard (row i goes to island i mod --num-learners); "
                        "default: the number at the end of --learner-id")
    p.add_argument("--num-learners", type=int, default=D.num_learners,
                   help="islands sharing the data")
    p.add_argument("--seed", type=int, default=D.seed, help="seed for init and batch order")
    p.add_argument("--max-steps", type=int, default=D.max_steps, help="optimizer steps to train")


def _add_training(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-r", type=int, default=D.lora_r, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=D.lora_alpha,
                   help="LoRA alpha (scale alpha/r)")
    p.add_argument("--lora-freeze-a", action="store_true",
                   help="draw lora_A from --seed on every island and never train or send it: "
                        "exact averaging of B, half the bytes")
    p.add_argument("--lora-targets", default=D.lora_targets,
                   help=f"{' | '.join(TARGET_MODES)} | comma list of module names. auto: "
                        "every linear of a dense model, attention only in a mixture-of-"
                        "experts model; all-linear (or an entry naming experts, e.g. "
                        "q_proj,experts) also adapts the experts, fused ones included "
                        "(routers stay frozen)")
    p.add_argument("--seq-len", type=int, default=D.seq_len, help="tokens per training block")
    p.add_argument("--batch-size", type=int, default=D.batch_size, help="blocks per micro-batch")
    p.add_argument("--grad-accum", type=int, default=D.grad_accum,
                   help="micro-batches per optimizer step")
    p.add_argument("--inner-lr", type=float, default=D.inner_lr, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=D.weight_decay, help="AdamW weight decay")
    p.add_argument("--eval-blocks", type=int, default=D.eval_blocks,
                   help="held-out blocks evaluated per sync (0 = all)")
    p.add_argument("--slowdown", type=float, default=D.slowdown,
                   help="simulate a slower machine: each step takes this many times as "
                        "long (benchmarks of mixed-speed fleets)")


def _add_sync(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sync-every", type=int, default=D.sync_every, metavar="H",
                   help="push to the syncer every H optimizer steps")
    p.add_argument("--wire", choices=codec.ENCODINGS, default=D.wire,
                   help="encoding of pushes (q4 keeps the residual: error feedback)")
    p.add_argument("--sync-every-seconds", type=float, default=D.sync_every_seconds, metavar="T",
                   help="push every T seconds of wall time instead of every H steps (fleets "
                        "of mixed speed; token weighting lets faster islands count more)")
    p.add_argument("--merge-alpha", type=float, default=D.merge_alpha,
                   help="keep this share of the local weights when merged weights arrive "
                        "(Streaming DiLoCo's alpha; 0 = adopt the merge plus the steps "
                        "made since the push)")
    p.add_argument("--pipeline", type=int, default=D.pipeline,
                   help="fragments in flight at once when the syncer runs --fragments P")
    p.add_argument("--blocking-sync", action="store_true",
                   help="wait for the merged weights after every push (islands then hold "
                        "identical weights after each round) instead of training on")


def _add_security_and_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default=D.token, help=f"syncer token (default: ${net.TOKEN_ENV})")
    p.add_argument("--tls-ca", type=Path, default=D.tls_ca, help="CA of the syncer's certificate")
    p.add_argument("--tls-cert", type=Path, default=D.tls_cert,
                   help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, default=D.tls_key, help="client key (mutual TLS)")
    p.add_argument("--keepalive-s", type=float, default=D.keepalive_s, metavar="S",
                   help="ping the syncer after S idle seconds; no answer within S more and "
                        "the link counts as down: the island trains on offline and reconnects "
                        "(a link that dies without closing its connections)")
    p.add_argument("--output", type=Path, default=D.output, help="where the final adapter is saved")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default=D.log_level)


def parse_island_args(p: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                      role: str = "island") -> IslandConfig:
    """Parse (with `--config`'s run file under the flags) and check, turning a
    `ConfigError` into the parser's usage error (exit 2)."""
    try:
        args = runfile.parse(p, argv, role, programs={"island": island_parser})
        return IslandConfig.from_args(args).check()
    except ConfigError as e:
        p.error(str(e))
