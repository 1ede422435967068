"""The island's push ledger: the work the syncer does not hold yet, per fragment.

It counts loss tokens and optimizer steps since each fragment's last push, records
each push in flight until its fate is known, and settles them: a push the syncer
refuses is carried forward (its decoded payload back into the error-feedback residual,
since the anchor already moved past it; its tokens and steps into the next push). So
is a push the syncer accepted but lost (it restarted from its last saved round): on
rejoin the syncer reports the newest push it holds, and every newer one is carried.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass

from yeto.codec import Encoder
from yeto.island.encoder import DeltaEncoder
from yeto.layout import Fragment
from yeto.transport import Lost, Refused, Transport, TransportError

log = logging.getLogger("yeto.island")


@dataclass(eq=False)
class Push:
    fragment: int
    seq: int
    generation: int
    encoded: Encoder             # the payload sent (a refusal carries it back)
    tokens: int
    steps: int
    future: Future
    accepted: bool | None = None  # None until the reply (or its loss) is known


class PushLedger:
    """Counters and pushes in flight of the island on `client`; work that is not held
    goes back through `encoder` (`DeltaEncoder.carry`)."""

    def __init__(self, client: Transport, encoder: DeltaEncoder):
        self.client, self.encoder = client, encoder
        self.pushed: list[Push] = []
        self.tokens: dict[int, int] = {}     # per fragment, since its last push
        self.steps: dict[int, int] = {}
        self.seq = 0
        self.pushes = 0

    def count(self, fragments: int, loss_tokens: int) -> None:
        """One optimizer step of `loss_tokens` tokens, for every fragment."""
        for f in range(fragments):
            self.tokens[f] = self.tokens.get(f, 0) + int(loss_tokens)
            self.steps[f] = self.steps.get(f, 0) + 1

    def owes(self, f: int) -> bool:
        """Fragment `f` holds steps not pushed yet."""
        return self.steps.get(f, 0) > 0

    def send(self, frag: Fragment, f: int, encoded: Encoder, base_version: int,
             train_loss: float, eval_loss: float) -> None:
        """Push fragment `f`'s work since its last push, as `encoded`."""
        self.seq = max(self.seq, self.client.acked_seq + 1)
        tokens, steps = self.tokens.get(f, 0), self.steps.get(f, 0)
        fut = self.client.push(encoded.payload, encoding=self.encoder.wire,
                               base_version=base_version, fragment=f, numel=frag.numel,
                               loss_tokens=tokens, steps=steps, seq=self.seq,
                               train_loss=_nan(train_loss), eval_loss=_nan(eval_loss))
        self.pushed.append(Push(f, self.seq, self.client.generation, encoded, tokens, steps,
                                fut))
        self.seq += 1
        self.pushes += 1
        self.tokens[f] = self.steps[f] = 0

    def in_flight(self, f: int | None = None) -> list[Push]:
        return [p for p in self.pushed if p.accepted is not False and f in (None, p.fragment)]

    def applied(self, f: int) -> None:
        """Θ of fragment `f` arrived: the syncer holds its pushes (or never will)."""
        self.pushed = [p for p in self.pushed if p.fragment != f]

    def settle(self, fragments: list[Fragment], wait: bool = False) -> None:
        """Learn the fate of pushes in flight; carry forward those the syncer does not hold."""
        for p in self.pushed:
            if p.accepted is None and (wait or p.future.done()):
                p.accepted = self._outcome(p)
        gen, acked = self.client.generation, self.client.acked_seq
        for p in self.pushed:  # the syncer restarted from a round saved before this push
            if p.accepted and p.generation != gen and p.seq > acked:
                p.accepted = False
        for f in {p.fragment for p in self.pushed if p.accepted is False}:
            mine = [p for p in self.pushed if p.fragment == f]
            lost = next(i for i, p in enumerate(mine) if p.accepted is False)
            self._carry_forward(fragments[f], f, mine[lost:])

    def _carry_forward(self, frag: Fragment, f: int, undone: list[Push]) -> None:
        log.warning("push %d not held by the syncer; its work goes into the next push",
                    undone[0].seq)
        for p in undone:  # the anchor moved past them: their work goes to the residual
            self.encoder.carry(p.encoded, frag.start, frag.start, frag.start + p.encoded.numel)
        self.tokens[f] = self.tokens.get(f, 0) + sum(p.tokens for p in undone)
        self.steps[f] = self.steps.get(f, 0) + sum(p.steps for p in undone)
        self.pushed = [p for p in self.pushed if all(p is not u for u in undone)]

    def _outcome(self, p: Push) -> bool | None:
        """True: the syncer holds the push; False: it does not (redo its work);
        None: unknown until the next join says (`acked_seq`)."""
        try:
            return p.future.result(timeout=300).kept
        except Refused as e:
            log.warning("push %d refused: %s", p.seq, e)
            return False
        except Lost as e:
            if self.client.generation != p.generation:
                return self.client.acked_seq >= p.seq
            log.warning("push %d: no reply (%s); the rejoin will tell", p.seq, e)
            return None
        except (TransportError, TimeoutError) as e:
            log.warning("push %d not delivered (%s)", p.seq, e)
            return False


def _nan(x: float) -> float:
    return x if x is not None and math.isfinite(x) else float("nan")
