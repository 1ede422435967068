"""The synthetic chat tasks: reverse the words, and one-digit arithmetic.

`make_task` writes ``train.jsonl`` and ``eval.jsonl`` of rows like user
"reverse: apple river stone" -> assistant "stone river apple", with disjoint prompts.
`copy_row` is the related task the tiny base is pretrained on (copy the words): it
teaches the vocabulary and the chat format, not the fine-tuning task.

`make_arithmetic_task` writes ``train.jsonl`` and ``held_out.jsonl`` of rows like user
"What is 3 * 7? Answer with just the number." -> assistant "21" (a + b with a, b in
1..9, a * b with a, b in 2..9), for GRPO with the `number_match` reward on a real
instruct model; held-out problems are whole unordered operand pairs.
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


ARITHMETIC_QUESTION = "What is {a} {op} {b}? Answer with just the number."


def arithmetic_problems() -> list[tuple[int, str, int]]:
    """Every (a, op, b) of the arithmetic task: a + b for a, b in 1..9, a * b in 2..9."""
    add = [(a, "+", b) for a in range(1, 10) for b in range(1, 10)]
    mul = [(a, "*", b) for a in range(2, 10) for b in range(2, 10)]
    return add + mul


def arithmetic_answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a * b


def make_arithmetic_task(out_dir: str | Path, held_share: float = 0.3,
                         seed: int = 1234) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``held_out.jsonl`` (chat rows, the answer as the
    assistant turn); held-out rows are whole unordered pairs (a op b and b op a go to the
    same side), chosen by `seed`."""
    rng = random.Random(seed)
    keys = sorted({(op, min(a, b), max(a, b)) for a, op, b in arithmetic_problems()})
    rng.shuffle(keys)
    held = set(keys[:round(held_share * len(keys))])
    rows: dict[bool, list[dict]] = {True: [], False: []}
    for a, op, b in arithmetic_problems():
        question = ARITHMETIC_QUESTION.format(a=a, op=op, b=b)
        rows[(op, min(a, b), max(a, b)) in held].append(
            {"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": str(arithmetic_answer(a, op, b))}]})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "held_out.jsonl"
    for path, side in zip(paths, (False, True)):
        random.Random(seed + 1).shuffle(rows[side])
        _write_jsonl(path, rows[side])
    return paths
