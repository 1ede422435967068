"""Reward functions: built-ins for the demo task, and `--reward module:function`.

A reward function scores one completion::

    def my_reward(completion: str, *, reference: str | None, prompt: str) -> float

`completion` is the sampled text (special tokens removed), `reference` the row's
answer (the last assistant turn of a chat row, the completion of a
prompt/completion row, or an "answer"/"reference" key; None when the row has
none), `prompt` the prompt text. Several ``--reward`` flags add up.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable

Reward = Callable[..., float]


def _task_reference(reference: str | None, prompt: str) -> str:
    """The expected reversal: the reference, or the words after "reverse:" reversed."""
    if reference is not None:
        return reference
    _, _, words = prompt.rpartition("reverse:")
    words = words.split("<|im_end|>")[0]
    return " ".join(reversed(words.split()))


def exact_match(completion: str, *, reference: str | None = None, prompt: str = "") -> float:
    """1.0 when the completion equals the reference (surrounding whitespace ignored)."""
    return float(completion.strip() == _task_reference(reference, prompt).strip())


def reversal_accuracy(completion: str, *, reference: str | None = None,
                      prompt: str = "") -> float:
    """Word-level accuracy of a reversal: the share of positions whose word is right,
    over the longer of the answer and the reference (extra words cost as much as
    missing ones)."""
    out, ref = completion.split(), _task_reference(reference, prompt).split()
    if not ref:
        return float(not out)
    hits = sum(a == b for a, b in zip(out, ref))
    return hits / max(len(ref), len(out))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _numbers(text: str) -> list[float]:
    return [float(n) for n in _NUMBER.findall(text.replace(",", ""))]


def number_match(completion: str, *, reference: str | None = None, prompt: str = "") -> float:
    """1.0 when the last number in the completion equals the reference's number (so
    "42", "The answer is 42." and "6 * 7 = 42" all score 1; "6 * 7 = 41" scores 0;
    thousands separators ignored); 0.0 when either has no number."""
    got, want = _numbers(completion), _numbers(reference or "")
    return float(bool(got) and bool(want) and got[-1] == want[-1])


BUILTIN: dict[str, Reward] = {"exact_match": exact_match,
                              "reversal_accuracy": reversal_accuracy,
                              "number_match": number_match}


def load_reward(spec: str) -> Reward:
    """A built-in by name, or ``module:function`` (e.g. ``mypkg.rewards:score``)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--reward {spec!r}: use a built-in ({', '.join(BUILTIN)}) or "
                         "module:function, e.g. --reward yeto.rl.rewards:exact_match")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec!r}: cannot import {name} from {module}: {e}") from e
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is not a function")
    return fn


def combine(fns: list[Reward]) -> Reward:
    """The sum of several rewards (one reward is returned as is)."""
    if len(fns) == 1:
        return fns[0]

    def total(completion: str, *, reference: str | None = None, prompt: str = "") -> float:
        return sum(float(f(completion, reference=reference, prompt=prompt)) for f in fns)

    total.__name__ = "+".join(getattr(f, "__name__", "reward") for f in fns)
    total.__signature__ = inspect.signature(exact_match)
    return total
