"""The synthetic chat task: reverse the words.

`make_task` writes ``train.jsonl`` and ``eval.jsonl`` of rows like user
"reverse: apple river stone" -> assistant "stone river apple", with disjoint prompts.
`copy_row` is the related task the tiny base is pretrained on (copy the words): it
teaches the vocabulary and the chat format, not the fine-tuning task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from yeto.io import atomic_write

WORDS = (
    "apple", "river", "stone", "cloud", "green", "tiger", "music", "paper", "light", "horse",
    "bread", "chair", "ocean", "plant", "smile", "train", "house", "water", "night", "dream",
)  # fmt: skip


def random_words(rng: random.Random) -> list[str]:
    """3 to 5 words drawn from `WORDS`."""
    return [rng.choice(WORDS) for _ in range(rng.randint(3, 5))]


def reverse_row(words: Sequence[str]) -> dict:
    """The fine-tuning task: reverse the words."""
    return {
        "messages": [
            {"role": "user", "content": "reverse: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    }


def copy_row(words: Sequence[str]) -> dict:
    """The related pretraining task: copy the words (teaches format, not the task)."""
    return {
        "messages": [
            {"role": "user", "content": "copy: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(words)},
        ]
    }


def task_rows(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows of the reverse task (no prompt in both)."""
    rng = random.Random(seed)
    n = n_train + n_eval
    # Prompts of 3-5 words over 20 words: ~3.4M possible, so uniqueness is cheap.
    if n > 100_000:
        raise ValueError(f"n_train + n_eval = {n} is too many; the task has <= 100000 rows")
    seen: dict[tuple[str, ...], None] = {}
    while len(seen) < n:
        seen.setdefault(tuple(random_words(rng)))
    prompts = list(seen)
    return [reverse_row(p) for p in prompts[n_eval:]], [reverse_row(p) for p in prompts[:n_eval]]


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))


def make_task(
    out_dir: str | Path, n_train: int = 2000, n_eval: int = 200, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` of the reverse-the-words chat task.

    Example row: user "reverse: apple river stone" -> assistant "stone river apple".
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = task_rows(n_train, n_eval, seed)
    train_path, eval_path = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    _write_jsonl(train_path, train)
    _write_jsonl(eval_path, held_out)
    return train_path, eval_path
