"""The island state machine, backend-neutral.

An island sees its trainable weights as one flat float32 vector in canonical order,
through the backend's callbacks: `get_weights() -> np.ndarray` and
`set_weights(np.ndarray)`, and, when the backend has them, range access
`read_range(lo, hi) -> np.ndarray` / `write_range(lo, hi, values)` (plus an optional
`flush()` after a batch of range accesses: see `yeto.loop.Weights`; an apply computes
in the array `read_range` returned and hands that array to `write_range`, which may
be a view of the weights themselves). Everything else is here. The flat vector is
cut into the syncer's P fragments (P = 1 unless the syncer runs `--fragments P`);
each fragment follows the same rules on its own slice:

- anchor: the exact Θ bytes last received, moved to the pushed weights by each
  push (anchor ← local): it is the point up to which the syncer holds this island's
  work. A push sends anchor − local, quantized with error feedback, so the pushes
  since Θ add up to Θ − local.
- counters: loss tokens and optimizer steps since the fragment's last push.
- apply: broadcasts are applied only at step boundaries, inside `after_step`.
  Training overlaps the round trip, so when Θ arrives the island keeps the steps it
  made since its push: local ← Θ + (local − anchor), anchor ← Θ. Every step is
  pushed exactly once; with `blocking=True` the island waits for Θ right after each
  push, so all islands hold bit-identical weights after every round.
  `merge_alpha` α mixes instead: local ← α·local + (1 − α)·(Θ + local − anchor);
  α = 0 (the default) keeps nothing of the pre-merge local weights but the steps
  the merge could not have seen, so islands stay as close to Θ as overlap allows.
  The first Θ an island receives is adopted with α = 0 (all islands start on it).
- a push the syncer refuses is carried forward: its decoded payload goes back into
  the error-feedback residual (the anchor already moved past it), its tokens and
  steps into the next push. So is a push the syncer accepted but lost (it restarted
  from its last saved round): on rejoin the syncer reports the newest push it holds,
  and the island carries forward every newer one.
- schedule: fragment f is pushed every H steps, offset by f·H/P (Streaming
  DiLoCo), or every T seconds with the same stagger; at most `pipeline`
  fragments are in flight at once.
- finish: a last push of every fragment, then the final Θ (f32) replaces the
  local weights exactly, so every island ends bit-identical to the syncer.

Memory, per trainable parameter, beyond the training loop itself:

- anchor: 4 B (f32, host memory; never on an accelerator). It used to sit beside a
  second copy, `base` (the weights at the last push, differing from the anchor only
  while a round is open), and a copy of both plus the residual per push in flight;
  moving the anchor at the push makes `base` unnecessary, and carrying a refused
  push's decoded payload into the residual replaces the copies (equal to restoring
  them up to float rounding). `base` could not have been kept as a sparse or
  compressed record: base − anchor is the pushed work itself, dense and needed in
  full precision to keep every step exactly once.
- error-feedback residual: 4 B with a q4 or bf16 wire; none with f32 (exact), unless
  a refused f32 push is carried into one.
- the payload of the push in flight, kept until its round commits (the bytes the
  client streams, and what a refusal carries back): 0.625 B (q4), 2 B (bf16),
  4 B (f32) per parameter of that fragment.
- the broadcast: streamed from the transport chunk by chunk into the model and the
  anchor when large (`ThetaStream`), else one fragment of f32 until applied. With a
  compressed downlink the client also keeps Θ (4 B) to add the syncer's updates to.
- chunk-sized scratch: every pass (push, apply, start) reads and writes the weights
  `chunk` values at a time (4 MiB of f32 by default), straight from the backend's
  tensors when it has range access; a push's encode holds up to threads + 1 pieces
  (two chunks each: the weights read and anchor − local), threads ≤ ENCODE_THREADS
  (4): 40 MiB at most. A backend without range access (`get`/`set` only, e.g.
  the MLX LoRA view) costs one full flat copy per pass, as before. Freed buffers go
  back to the OS after each pass (`yeto.memory.trim`).

So a q4 island holds about 8.6 B per parameter, an f32-wire island 8 B.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from yeto import codec
from yeto.codec import Q4_BLOCK, CodecError, Encoder, ErrorFeedback
from yeto.codec.chunked import ranges
from yeto.layout import Fragment, Layout
from yeto.memory import trim
from yeto.transport import Lost, Received, Refused, ThetaStream, Transport, TransportError

log = logging.getLogger("yeto.island")

CHUNK = 1 << 20  # values per piece of a pass over the weights (4 MiB of f32)
ENCODE_THREADS = 4  # at most, for a push's encode (scripts/bench_codec.py measures it)


@dataclass(eq=False)
class _Push:
    fragment: int
    seq: int
    generation: int
    encoded: Encoder             # the payload sent (a refusal carries it back)
    tokens: int
    steps: int
    future: Future
    accepted: bool | None = None  # None until the reply (or its loss) is known


class _Direct:
    """One pass over the weights through the backend's own range access."""

    def __init__(self, read, write):
        self.read, self.write = read, write


class _Flat:
    """One pass over the weights of a backend without range access: one get() at the
    start, one set() at the end (when written)."""

    def __init__(self, flat: np.ndarray):
        self.flat, self.dirty = flat, False

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.flat[lo:hi]

    def write(self, lo: int, hi: int, values: np.ndarray) -> None:
        self.flat[lo:hi] = values
        self.dirty = True


class Island:
    def __init__(self, layout: Layout, get_weights: Callable[[], np.ndarray],
                 set_weights: Callable[[np.ndarray], None], *, client: Transport | None,
                 sync_every: int = 50, sync_every_seconds: float = 0.0, wire: str = "q4",
                 blocking: bool = False, merge_alpha: float = 0.0, pipeline: int = 1,
                 on_sync: Callable[[], float] | None = None,
                 on_apply: Callable[[Received], None] | None = None,
                 start_timeout_s: float | None = None, connect_grace_s: float = 5.0,
                 finish_timeout_s: float = 1800.0, offline_give_up_s: float = 60.0,
                 read_range: Callable[[int, int], np.ndarray] | None = None,
                 write_range: Callable[[int, int, np.ndarray], None] | None = None,
                 flush: Callable[[], None] | None = None, chunk: int = CHUNK,
                 threads: int | None = None, clock: Callable[[], float] = time.monotonic):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        if not 0.0 <= merge_alpha < 1.0:
            raise ValueError("merge_alpha must be in [0, 1)")
        if chunk < Q4_BLOCK or chunk % Q4_BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {Q4_BLOCK}")
        self.layout, self.client = layout, client
        self._get, self._set = get_weights, set_weights
        self._read, self._write, self._flush = read_range, write_range, flush
        if (read_range is None) != (write_range is None):
            raise ValueError("give both read_range and write_range, or neither")
        self.chunk = int(chunk)
        # threads that encode a push (training waits for it): the island's cores
        self.threads = max(1, threads if threads is not None else default_threads())
        self.sync_every, self.wire, self.blocking = sync_every, wire, blocking
        # sync by wall time instead of steps: islands of mixed speed push at the same
        # rate, and token weighting lets the faster one count for more
        self.sync_every_seconds = float(sync_every_seconds)
        self.clock = clock  # of --sync-every-seconds (yeto.sim: simulated time)
        self.merge_alpha, self.pipeline = float(merge_alpha), max(1, pipeline)
        self.on_sync, self.on_apply = on_sync, on_apply
        self.start_timeout_s, self.connect_grace_s = start_timeout_s, connect_grace_s
        self.finish_timeout_s, self.offline_give_up_s = finish_timeout_s, offline_give_up_s
        self.feedback = ErrorFeedback(layout.numel, wire)
        self.anchor: np.ndarray | None = None
        self.pushed: list[_Push] = []
        self.versions: dict[int, int] = {}   # fragment -> version of its anchor
        self.finals: set[int] = set()        # fragments whose final weights arrived
        self._partial: set[int] = set()      # fragments whose last broadcast broke off
        self.step = 0
        self.tokens: dict[int, int] = {}     # per fragment, since its last push
        self.steps: dict[int, int] = {}
        self.total_tokens = 0
        self.seq = 0
        self.finished = False
        self.train_loss = float("nan")
        self.eval_loss = float("nan")
        self.pushes = 0
        self._t0 = clock()
        self._next_due: dict[int, float] = {}

    @classmethod
    def for_weights(cls, weights, **options) -> Island:
        """An island over a `yeto.loop.Weights` object (`layout`, `get`, `set`), using its
        range access (`read_range`, `write_range`, `flush`) when it has it."""
        return cls(weights.layout, weights.get, weights.set,
                   read_range=getattr(weights, "read_range", None),
                   write_range=getattr(weights, "write_range", None),
                   flush=getattr(weights, "flush", None), **options)

    # ---- fragments --------------------------------------------------------
    @property
    def fragments(self) -> list[Fragment]:
        p = self.client.num_fragments if self.client else 1
        if len(self.layout.fragments) != p:
            self.layout = self.layout.with_fragments(p)
        return self.layout.fragments

    @property
    def version(self) -> int:
        """Newest version applied (-1 before joining a run)."""
        return max(self.versions.values(), default=-1)

    @contextlib.contextmanager
    def _pass(self):
        """Range access to the weights for one pass (push, apply, start)."""
        if self._read is not None:
            try:
                yield _Direct(self._read, self._write)
            finally:
                if self._flush is not None:
                    self._flush()
                trim()
            return
        view = _Flat(np.asarray(self._get(), dtype=np.float32))
        try:
            yield view
        finally:
            if view.dirty:
                self._set(view.flat)
            del view
            trim()

    # ---- start ------------------------------------------------------------
    def start(self) -> None:
        """Join the run and adopt its Θ; trains locally if the syncer is unreachable.
        A single island (no client) pushes nothing and keeps no anchor."""
        if self.client is None:
            return
        self.anchor = self._read_all()
        if hasattr(self.client, "stream_broadcasts"):
            self.client.stream_broadcasts()
        self.client.start(self.anchor)
        t0 = last_log = time.monotonic()
        while True:
            self._apply_all(self.client.wait(timeout=1.0))
            if len(self.versions) == len(self.fragments):
                break
            if self.client.fatal:
                raise Refused(self.client.fatal)
            waited = time.monotonic() - t0
            if not self.client.connected.is_set() and waited >= self.connect_grace_s:
                log.warning("syncer %s not reachable after %.0fs: training locally; the island "
                            "joins when it comes up", self.client.address, waited)
                break
            if self.start_timeout_s is not None and waited >= self.start_timeout_s:
                log.warning("no weights from the syncer after %.0fs: training locally", waited)
                break
            if time.monotonic() - last_log >= 10:
                log.info("waiting for the syncer to start round 1 (quorum) ...")
                last_log = time.monotonic()
        self._t0 = self.clock()

    def _read_all(self) -> np.ndarray:
        """The weights as a new flat array (the anchor), chunk by chunk."""
        if self._read is None:
            return np.array(self._get(), dtype=np.float32)
        out = np.empty(self.layout.numel, dtype=np.float32)
        with self._pass() as w:
            for lo, hi in ranges(0, self.layout.numel, self.chunk):
                out[lo:hi] = w.read(lo, hi)
        return out

    # ---- per step ---------------------------------------------------------
    def after_step(self, loss_tokens: int, train_loss: float | None = None) -> bool:
        """Call once per optimizer step. Applies arrived weights, pushes when due.
        Returns True when the run is over (the final weights are loaded)."""
        self.step += 1
        self.total_tokens += int(loss_tokens)
        for f in range(len(self.fragments)):
            self.tokens[f] = self.tokens.get(f, 0) + int(loss_tokens)
            self.steps[f] = self.steps.get(f, 0) + 1
        if train_loss is not None:
            self.train_loss = float(train_loss)
        if self.client is None:  # a single island: still evaluate every H steps
            if self.on_sync is not None and self.step % self.sync_every == 0:
                self.eval_loss = float(self.on_sync())
            return False
        self._apply_all(self.client.take())
        for f in self._due():
            if self.finished:
                break
            self.sync(f)
        return self.finished

    def _due(self) -> list[int]:
        p = len(self.fragments)
        if self.sync_every_seconds > 0:
            now, period = self.clock(), self.sync_every_seconds
            due = []
            for f in range(p):
                nxt = self._next_due.setdefault(f, self._t0 + period * (f + 1) / p)
                if now >= nxt:
                    due.append(f)
                    self._next_due[f] = now + period
            return due
        offsets = [((f + 1) * self.sync_every) // p for f in range(p)]  # the last is H
        return [f for f in range(p)
                if self.step >= offsets[f] and (self.step - offsets[f]) % self.sync_every == 0]

    def sync(self, fragment: int = 0) -> None:
        """Push fragment `fragment` (anchor − local) now; training continues meanwhile."""
        if self.client is None or self.finished:
            return
        f = fragment
        if not self._room_for(f):
            return  # run over, or offline: the work waits for a later push
        if self.on_sync is not None:
            self.eval_loss = float(self.on_sync())
        if not self.client.connected.is_set() or f not in self.versions:
            return  # offline: the work stays in anchor − local for a later push
        self._push(f)
        if self.blocking:
            while self._in_flight(f) and not self.finished:
                got = self.client.wait(timeout=self.finish_timeout_s, need_connection=True)
                self._apply_all(got)
                self._settle()
                if not got:
                    break

    def _room_for(self, f: int) -> bool:
        """Wait for the rounds in flight to commit (one per fragment, `pipeline` in all);
        False when the run ended or the syncer went away meanwhile."""
        self._settle()
        while self._in_flight(f) or len(self._in_flight()) >= self.pipeline:
            got = self.client.wait(timeout=self.finish_timeout_s, need_connection=True)
            self._apply_all(got)
            self._settle()
            if self.finished or not got:
                return False
        return True

    def _push(self, f: int) -> None:
        frag = self.fragments[f]
        encoded = self._encode(frag)
        self.seq = max(self.seq, self.client.acked_seq + 1)
        tokens, steps = self.tokens.get(f, 0), self.steps.get(f, 0)
        fut = self.client.push(encoded.payload, encoding=self.wire,
                               base_version=self.versions[f], fragment=f, numel=frag.numel,
                               loss_tokens=tokens, steps=steps, seq=self.seq,
                               train_loss=_nan(self.train_loss), eval_loss=_nan(self.eval_loss))
        self.pushed.append(_Push(f, self.seq, self.client.generation, encoded, tokens, steps,
                                 fut))
        self.seq += 1
        self.pushes += 1
        self.tokens[f] = self.steps[f] = 0

    def _encode(self, frag: Fragment) -> Encoder:
        """anchor − local plus the residual, encoded chunk by chunk straight from the
        weights; the anchor moves to local. The weights are read in order (a sharded
        backend gathers them in turn); the pieces are encoded by `threads` threads
        (numpy lets go of the GIL), each on its own slice of the payload, residual and
        anchor, so the bytes are those of one thread. On a CodecError (non-finite
        weights) the pieces already encoded are carried back, so nothing is lost, and
        it re-raises."""
        enc = Encoder(self.wire, frag.numel)
        done: list[tuple[int, int]] = []
        n = min(self.threads, -(-frag.numel // self.chunk))
        scratch: queue.SimpleQueue = queue.SimpleQueue()  # one per piece in flight
        for _ in range(n + 1 if n > 1 else 1):
            scratch.put(_Scratch(min(self.chunk, frag.numel)))
        with self._pass() as w, _Workers(n) as workers:
            try:
                for lo, hi in ranges(frag.start, frag.stop, self.chunk):
                    local = w.read(lo, hi)
                    workers.submit(self._encode_piece, enc, frag.start, lo, hi, local, scratch)
                    done += workers.finished()
                done += workers.drain()
            except CodecError:
                done += workers.drain(errors=False)
                for lo, hi in done:
                    self._carry(enc, frag.start, lo, hi)
                raise
        self.feedback.done()
        return enc

    def _encode_piece(self, enc: Encoder, start: int, lo: int, hi: int, local: np.ndarray,
                      scratch: queue.SimpleQueue) -> tuple[int, int]:
        """One piece, a q4 chunk at a time: its values stay in the CPU cache from the
        difference to the residual and the anchor's move. A CodecError carries the
        chunks already encoded back (as for whole pieces) and leaves the rest as it was."""
        s = scratch.get()
        try:
            for a, b in ranges(lo, hi, s.codec.chunk):
                mine = local[a - lo:b - lo]
                x = np.subtract(self.anchor[a:b], mine, out=s.x[:b - a])
                try:
                    self.feedback.encode_piece(x, enc, a - start, a, s.codec)
                except CodecError:
                    self._carry(enc, start, lo, a)
                    raise
                self.anchor[a:b] = mine
        finally:
            scratch.put(s)
        return lo, hi

    def _carry(self, enc: Encoder, start: int, lo: int, hi: int) -> None:
        """Values [lo, hi) of a payload whose first value is `start` (its fragment's
        start), decoded back into the residual: work the syncer does not hold."""
        for a, b in ranges(lo, hi, self.chunk):
            self.feedback.carry(a, enc.decoded(a - start, b - start))

    def _in_flight(self, f: int | None = None) -> list[_Push]:
        return [p for p in self.pushed if p.accepted is not False and f in (None, p.fragment)]

    # ---- apply ------------------------------------------------------------
    def _apply_all(self, received: list[Received]) -> None:
        if not received:
            return
        self._settle(wait=True)
        applied = []
        with self._pass() as w:
            for got in received:
                f = got.fragment
                if got.version == self.versions.get(f) and not got.final \
                        and f not in self._partial:
                    _discard(got.theta)
                    continue  # a rejoin re-sends the current Θ: nothing new
                if not self._apply(got, w):
                    continue
                if got.final:
                    self.finals.add(f)
                self.pushed = [p for p in self.pushed if p.fragment != f]
                self.versions[f] = got.version
                applied.append(got)
        self.finished = len(self.finals) == len(self.fragments)
        for got in applied if self.on_apply is not None else ():
            self.on_apply(got)

    def _apply(self, got: Received, w) -> bool:
        """Θ into the model and the anchor, chunk by chunk (as it streams in). False when
        a streamed broadcast broke off: the chunks applied stay applied (each as a whole
        apply would have done it), and the fragment's next broadcast is applied whatever
        its version."""
        frag = self.fragments[got.fragment]
        # α mixes merges; the run's first Θ is adopted as is (every island starts on it)
        alpha = self.merge_alpha if got.fragment in self.versions else 0.0
        self._partial.add(got.fragment)
        scratch = np.empty(min(self.chunk, frag.numel), np.float32)  # reused by every piece
        try:
            for lo, theta in _pieces(got.theta, frag, self.chunk):
                hi = lo + theta.size
                if got.final:
                    w.write(lo, hi, theta)
                    self.anchor[lo:hi] = theta
                else:
                    w.write(lo, hi, self._merge(w.read(lo, hi), lo, theta, alpha, scratch))
        except TransportError as e:
            log.warning("broadcast of fragment %d (version %d) broke off: %s; its next "
                        "broadcast is applied whatever its version", got.fragment,
                        got.version, e)
            return False
        self._partial.discard(got.fragment)
        return True

    def _merge(self, local: np.ndarray, lo: int, theta: np.ndarray, alpha: float,
               scratch: np.ndarray) -> np.ndarray:
        """Θ + (local − anchor) (the island's own steps kept) for values [lo, lo + len(Θ)),
        and the anchor moved to Θ, a q4 chunk at a time (in the CPU cache). The sum goes
        into `local` itself when it can (what `read_range` returns is the island's to
        change), so a backend whose read is a view of its weights copies nothing."""
        in_place = not alpha and local.flags.writeable
        out = local if in_place else scratch[:theta.size]
        for a, b in ranges(0, theta.size, codec.CHUNK):
            m = np.subtract(local[a:b], self.anchor[lo + a:lo + b], out=out[a:b])
            m += theta[a:b]
            if alpha:
                m[...] = alpha * local[a:b] + (1 - alpha) * m
            self.anchor[lo + a:lo + b] = theta[a:b]
        return out

    def _settle(self, wait: bool = False) -> None:
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
            undone = mine[lost:]
            frag = self.fragments[f]
            log.warning("push %d not held by the syncer; its work goes into the next push",
                        undone[0].seq)
            for p in undone:  # the anchor moved past them: their work goes to the residual
                self._carry(p.encoded, frag.start, frag.start, frag.start + p.encoded.numel)
            self.tokens[f] = self.tokens.get(f, 0) + sum(p.tokens for p in undone)
            self.steps[f] = self.steps.get(f, 0) + sum(p.steps for p in undone)
            self.pushed = [p for p in self.pushed if all(p is not u for u in undone)]

    def _outcome(self, p: _Push) -> bool | None:
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

    # ---- finish -----------------------------------------------------------
    def finish(self) -> bool:
        """Last push of every fragment, then wait for the final Θ. Returns True when
        the final weights were received (the island is then bit-identical to the syncer)."""
        if self.client is None:
            return False
        try:
            finish_sent = 0  # generation the Finish went to; a rejoin needs it again
            t0 = last_seen = time.monotonic()
            while (not self.finished and self.versions
                   and time.monotonic() - t0 < self.finish_timeout_s):
                if self.client.connected.is_set():
                    last_seen = time.monotonic()
                    self._settle()
                    todo = [f for f in range(len(self.fragments))
                            if self.steps.get(f, 0) > 0 and not self._in_flight(f)]
                    if todo and len(self._in_flight()) < self.pipeline:
                        pushes = self.pushes
                        self.sync(todo[0])  # the last work (again, if a restart lost it)
                        if self.blocking and self.pushes > pushes and not self._in_flight():
                            continue  # its round committed already: say Finish at once
                    elif not todo and not self._in_flight() and \
                            finish_sent != self.client.generation:
                        finish_sent = self.client.generation
                        self.client.finish()
                self._apply_all(self.client.wait(timeout=1.0))
                if self.client.fatal or time.monotonic() - last_seen > self.offline_give_up_s:
                    break
            if not self.finished:
                log.warning("no final weights from the syncer; keeping local weights")
            return self.finished
        finally:
            self.client.close()


def _nan(x: float) -> float:
    return x if x is not None and math.isfinite(x) else float("nan")


def default_threads() -> int:
    """Threads for a push's encode: the cores this process may use, at most
    ENCODE_THREADS (each thread holds one `chunk` piece in flight)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(ENCODE_THREADS, cores))


class _Scratch:
    """What one piece of a push's encode works in: its difference and the codec's
    buffers (a thread holds one while it encodes a piece)."""

    def __init__(self, n: int):
        self.x = np.empty(min(n, codec.CHUNK), dtype=np.float32)
        self.codec = codec.Scratch(self.x.size)


class _Workers:
    """Run calls on up to `n` threads, at most n + 1 at a time (each holds a piece);
    with n = 1, in the caller's thread. `finished()` and `drain()` return the results
    of the calls that completed, in order of completion, and raise the first error."""

    def __init__(self, n: int):
        self.n = max(1, int(n))
        self.pool = ThreadPoolExecutor(self.n, "yeto-encode") if self.n > 1 else None
        self.running: list[Future] = []
        self.results: list = []

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            self.results.append(fn(*args))
            return
        if len(self.running) > self.n:
            wait(self.running, return_when=FIRST_COMPLETED)
            self._collect(errors=True)
        self.running.append(self.pool.submit(fn, *args))

    def finished(self) -> list:
        self._collect(errors=True)
        out, self.results = self.results, []
        return out

    def drain(self, errors: bool = True) -> list:
        """Wait for every call; the results of those that succeeded (raises the first
        error unless `errors` is False)."""
        wait(self.running)
        self._collect(errors)
        out, self.results = self.results, []
        return out

    def _collect(self, errors: bool) -> None:
        first = None
        for f in [f for f in self.running if f.done()]:
            self.running.remove(f)
            if f.exception() is None:
                self.results.append(f.result())
            elif first is None:
                first = f.exception()
        if first is not None and errors:
            raise first


def _pieces(theta, frag: Fragment, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """(flat offset, values) pieces of a fragment's Θ, whole or streamed, none longer
    than `chunk`."""
    if isinstance(theta, ThetaStream):
        if theta.numel != frag.numel:
            theta.discard()
            raise Lost(f"broadcast of {theta.numel} values for a fragment of {frag.numel}")
        pieces = theta.pieces()
    else:
        pieces = iter((np.asarray(theta, dtype=np.float32),))
    pos = frag.start
    for piece in pieces:
        if pos + piece.size > frag.stop:
            raise Lost("broadcast longer than its fragment")
        for lo, hi in ranges(0, piece.size, chunk):
            yield pos + lo, piece[lo:hi]
        pos += piece.size


def _discard(theta) -> None:
    if isinstance(theta, ThetaStream):
        theta.discard()
