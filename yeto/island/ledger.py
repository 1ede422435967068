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
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from yeto.codec import Encoder
from yeto.island.encoder import DeltaEncoder
from yeto.layout import Fragment
from yeto.transport import OVER_SCHEDULE, Lost, Refused, Transport, TransportError

log = logging.getLogger("yeto.island")
PUSH_TIMEOUT_S = 300.0  # the longest a settle waits for one push's reply


@dataclass(eq=False)
class Push:
    fragment: int
    seq: int
    generation: int
    encoded: Encoder | None      # the payload sent (a refusal carries it back); None
    tokens: int                  # until its encode is done
    steps: int
    future: Future               # the reply: done once encoded, sent and answered
    accepted: bool | None = None  # None until the reply (or its loss) is known
    over_claimed: bool = False   # refused as claiming more steps than the syncer allows
    encode_s: float = 0.0        # seconds its encode took (on the background thread)


class PushLedger:
    """Counters and pushes in flight of the island on `client`; work that is not held
    goes back through `encoder` (`DeltaEncoder.carry`)."""

    def __init__(self, client: Transport, encoder: DeltaEncoder, max_steps: int = 0):
        """`max_steps`: what a push claims after the syncer refused a claim as more
        than its schedule allows (0: no cap): H × `CARRY_SLACK` for a schedule of H
        steps, what the syncer allows an island that missed no commit. Steps taken
        while no round committed (the syncer down, the quorum not met) all go into
        the next push, which may claim more than that: then the work still goes out
        whole, and only its claim is cut to what the syncer takes (without the cut,
        every later push would carry the refused claim and be refused too)."""
        self.client, self.encoder, self.max_steps = client, encoder, max_steps
        self.pushed: list[Push] = []
        self.tokens: dict[int, int] = {}     # per fragment, since its last push
        self.steps: dict[int, int] = {}
        self.seq = 0
        self.pushes = 0
        self.encode_s: list[float] = []  # per push: seconds its encode took

    def count(self, fragments: int, loss_tokens: int) -> None:
        """One optimizer step of `loss_tokens` tokens, for every fragment."""
        for f in range(fragments):
            self.tokens[f] = self.tokens.get(f, 0) + int(loss_tokens)
            self.steps[f] = self.steps.get(f, 0) + 1

    def owes(self, f: int) -> bool:
        """Fragment `f` holds steps not pushed yet."""
        return self.steps.get(f, 0) > 0

    def send(self, frag: Fragment, f: int, encode: Callable[[], Encoder], base_version: int,
             train_loss: float, eval_loss: float, executor: Executor) -> Push:
        """Push fragment `f`'s work since its last push: `encode()` (the rest of a staged
        encode, `DeltaEncoder.encode_staged`) then the transport's push, both on
        `executor` (a background thread, or the caller's); the counters move to the
        push at once. The push's future resolves to the syncer's reply."""
        self.seq = max(self.seq, self.client.acked_seq + 1)
        tokens, steps = self.tokens.get(f, 0), self.steps.get(f, 0)
        p = Push(f, self.seq, self.client.generation_for(f), None, tokens, steps, Future())
        self.pushed.append(p)
        self.seq += 1
        self.pushes += 1
        self.tokens[f] = self.steps[f] = 0
        header = dict(encoding=self.encoder.wire, base_version=base_version, fragment=f,
                      numel=frag.numel, loss_tokens=tokens, steps=steps, seq=p.seq,
                      train_loss=_nan(train_loss), eval_loss=_nan(eval_loss))
        executor.submit(self._deliver, p, encode, header)
        return p

    def _deliver(self, p: Push, encode: Callable[[], Encoder], header: dict) -> None:
        """Encode, then hand the payload to the transport; its reply (or error)
        resolves `p.future`, as does an error of the encode."""
        t0 = time.perf_counter()
        try:
            p.encoded = encode()
            p.encode_s = time.perf_counter() - t0
            self.encode_s.append(p.encode_s)
            p.generation = self.client.generation_for(p.fragment)
            sent = self.client.push(p.encoded.payload, **header)
        except BaseException as e:  # noqa: BLE001 - the push's future carries it
            p.future.set_exception(e)
            return
        sent.add_done_callback(lambda done: _settle_future(done, p.future))

    def withdraw(self, p: Push) -> None:
        """A push whose staging failed: nothing of it was sent (what it staged is exact
        in the residual), so its tokens and steps are owed again."""
        self.pushed = [q for q in self.pushed if q is not p]
        self.pushes -= 1
        self.tokens[p.fragment] = self.tokens.get(p.fragment, 0) + p.tokens
        self.steps[p.fragment] = self.steps.get(p.fragment, 0) + p.steps

    def in_flight(self, f: int | None = None) -> list[Push]:
        return [p for p in self.pushed if p.accepted is not False and f in (None, p.fragment)]

    def applied(self, f: int) -> None:
        """Θ of fragment `f` arrived: the syncer holds its pushes (or never will)."""
        self.pushed = [p for p in self.pushed if p.fragment != f]

    def settle(self, fragments: list[Fragment], wait: bool = False,
               only: set[int] | None = None) -> None:
        """Learn the fate of pushes in flight (`wait`: of those of the fragments in
        `only`, all by default, waiting for their replies); carry forward those the
        syncer does not hold."""
        for p in self.pushed:
            waits = wait and (only is None or p.fragment in only)
            if p.accepted is None and (waits or p.future.done()):
                p.accepted = self._outcome(p)
        for p in self.pushed:  # the syncer restarted from a round saved before this push
            if p.accepted and p.generation != self.client.generation_for(p.fragment) and \
                    p.seq > self.client.acked_seq_for(p.fragment):
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
        steps = self.steps[f]
        if self.max_steps and steps > self.max_steps and any(p.over_claimed for p in undone):
            log.warning("push %d claimed more steps than the syncer allows: the next push "
                        "claims %d of the %d steps it carries", undone[0].seq,
                        self.max_steps, steps)
            self.tokens[f] = self.tokens[f] * self.max_steps // steps
            self.steps[f] = self.max_steps
        self.pushed = [p for p in self.pushed if all(p is not u for u in undone)]

    def _outcome(self, p: Push) -> bool | None:
        """True: the syncer holds the push; False: it does not (redo its work);
        None: unknown until the next join says (`acked_seq`)."""
        try:
            return p.future.result(timeout=PUSH_TIMEOUT_S).kept
        except Refused as e:
            log.warning("push %d refused: %s", p.seq, e)
            p.over_claimed = OVER_SCHEDULE in str(e)
            return False
        except Lost as e:
            if self.client.generation_for(p.fragment) != p.generation:
                return self.client.acked_seq_for(p.fragment) >= p.seq
            log.warning("push %d: no reply (%s); the rejoin will tell", p.seq, e)
            return None
        except (TransportError, TimeoutError) as e:
            if p.encoded is None:  # still encoding: it goes out when done
                log.warning("push %d still encoding after %.0f s", p.seq, PUSH_TIMEOUT_S)
                return None
            log.warning("push %d not delivered (%s)", p.seq, e)
            return False


def _settle_future(done: Future, into: Future) -> None:
    """`into` resolves as `done` did."""
    if done.exception() is not None:
        into.set_exception(done.exception())
    else:
        into.set_result(done.result())


def _nan(x: float) -> float:
    return x if x is not None and math.isfinite(x) else float("nan")
