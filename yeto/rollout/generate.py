"""Batched sampling with a KV cache, written once for every backend.

A backend (`yeto.rollout.torch_engine.TorchEngine`, `yeto.rollout.mlx_engine.MLXEngine`)
supplies four calls over its own KV cache:

    prefill(prompt ids) -> (cache, logits of the last position (V,))
    merge([cache per row]) -> state     rows of one batch: keys left-padded, conv and
                                        recurrent states (hybrid models) stacked
    decode(state, tokens (B,)) -> logits (B, V)   one token per row, cache extended
    filter(state, keep [row index]) -> state      drop finished rows

Each distinct prompt is prefilled once and its cache shared by all rows that ask
for it (the G completions of a GRPO group), so no prompt is ever padded: pad
positions exist only as masked keys, never as queries nor as inputs of a conv or
state-space layer, and the numbers of a row do not depend on the others in its
batch.

Sampling is numpy, batched, with each row's own seed: temperature, top-k, top-p
(a Gumbel-max draw, see `choose`).
The log-probability returned for each sampled token is under the model's own
distribution at temperature 1, before temperature, top-k and top-p (what vLLM
returns by default), computed in float64 from the float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (validated by `yeto.rollout.api`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None    # alternatives per position (0: only the sampled token)


@dataclass
class Row:
    """One completion to sample: its prompt, settings and random stream."""

    prompt: tuple[int, ...]
    params: SamplingParams
    rng: np.random.Generator


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None
    finish_reason: str = "length"      # stop | length
    stop_reason: int | str | None = None
    text: str = ""


class Engine(Protocol):
    name: str

    def prefill(self, prompt: Sequence[int]) -> tuple[Any, np.ndarray]: ...

    def merge(self, caches: list[Any]) -> Any: ...

    def decode(self, state: Any, tokens: np.ndarray) -> np.ndarray: ...

    def filter(self, state: Any, keep: list[int]) -> Any: ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def _filtered(lp: np.ndarray, p: SamplingParams) -> np.ndarray:
    """`lp` / temperature, with the tokens top-k and top-p leave out at -inf."""
    z = lp / p.temperature
    if 0 < p.top_k < z.size:
        cut = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z >= cut, z, -np.inf)
    if p.top_p < 1.0:
        probs = np.exp(z - z.max())
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order]) / probs.sum()
        drop = order[int(np.searchsorted(cum, p.top_p)) + 1:]
        z = z.copy()
        z[drop] = -np.inf
    return z


def choose(lp: np.ndarray, rows: list[Row]) -> np.ndarray:
    """One token id per row of log-probabilities `lp` (B, V), under each row's
    settings: greedy, or a draw from softmax(filtered lp / T) by the Gumbel-max trick
    (the argmax of z + Gumbel noise), with the noise from the row's own generator."""
    toks = np.empty(len(rows), dtype=np.int64)
    drawn = []
    for j, r in enumerate(rows):
        if r.params.temperature == 0 or r.params.top_k == 1:
            toks[j] = int(np.argmax(lp[j]))
        else:
            drawn.append(j)
    if drawn:
        z = np.stack([_filtered(lp[j], rows[j].params) for j in drawn])
        u = np.stack([rows[j].rng.random(lp.shape[1]) for j in drawn])
        with np.errstate(divide="ignore"):
            toks[drawn] = np.argmax(z - np.log(-np.log(u)), axis=1)
    return toks


def _top(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    idx = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    return [(int(i), float(lp[i])) for i in idx]


class _Track:
    """One row in flight: takes a token per step and knows when it is done."""

    def __init__(self, row: Row, eos: frozenset[int], detok: Callable[[list[int]], str]):
        self.row, self.detok, self.done = row, detok, False
        p = row.params
        self.stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos)
        self.out = Output(top=[] if p.logprobs else None)

    def take(self, tok: int, lp: np.ndarray) -> int:
        """Record sampled token `tok` (its row of log-probabilities is `lp`)."""
        p, out = self.row.params, self.out
        out.token_ids.append(tok)
        out.logprobs.append(float(lp[tok]))
        if out.top is not None:
            out.top.append(_top(lp, p.logprobs))
        if tok in self.stops:
            self.done, out.finish_reason, out.stop_reason = True, "stop", tok
        elif p.stop and self._stop_string():
            self.done = True
        elif len(out.token_ids) >= p.max_tokens:
            self.done, out.finish_reason = True, "length"
        return tok

    def _stop_string(self) -> bool:
        text = self.detok(self.out.token_ids)
        hits = [(text.find(s), s) for s in self.row.params.stop if s and s in text]
        if not hits:
            return False
        at, s = min(hits)
        self.out.text, self.out.finish_reason, self.out.stop_reason = text[:at], "stop", s
        return True

    def result(self) -> Output:
        if not isinstance(self.out.stop_reason, str):
            self.out.text = self.detok(self.out.token_ids)
        return self.out


def generate(engine: Engine, rows: list[Row], eos_ids: Sequence[int],
             detok: Callable[[list[int]], str]) -> list[Output]:
    """Sample every row to its end as one batch; returns one `Output` per row."""
    if not rows:
        return []
    first: dict[tuple[int, ...], tuple[Any, np.ndarray]] = {}
    for r in rows:  # one prefill per distinct prompt, shared by its rows
        if r.prompt not in first:
            first[r.prompt] = engine.prefill(r.prompt)
    tracks = [_Track(r, frozenset(eos_ids), detok) for r in rows]
    logits = np.stack([first[r.prompt][1] for r in rows])
    state = engine.merge([first[r.prompt][0] for r in rows])
    first.clear()
    active = list(range(len(rows)))
    while True:
        lp = log_softmax(logits)
        chosen = choose(lp, [tracks[i].row for i in active])
        tokens = [tracks[i].take(int(chosen[j]), lp[j]) for j, i in enumerate(active)]
        keep = [j for j, i in enumerate(active) if not tracks[i].done]
        if not keep:
            break
        if len(keep) < len(active):
            state = engine.filter(state, keep)
            active, tokens = [active[j] for j in keep], [tokens[j] for j in keep]
        logits = engine.decode(state, np.asarray(tokens, dtype=np.int64))
    return [t.result() for t in tracks]


def make_rows(prompt: Sequence[int], params: SamplingParams, n: int,
              salt: int = 0) -> list[Row]:
    """`n` rows of one prompt; with a seed, choice j draws from (seed, salt, j), so a
    request with the same seed samples the same completions in any batch."""
    rows = []
    for j in range(n):
        seed = None if params.seed is None else [params.seed & 0xFFFFFFFFFFFFFFFF, salt, j]
        rows.append(Row(tuple(int(t) for t in prompt), params, np.random.default_rng(seed)))
    return rows
