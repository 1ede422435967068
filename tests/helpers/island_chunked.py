"""What the island chunked tests in more than one tier share."""

import threading
from concurrent.futures import Future

import numpy as np

from helpers.syncer import make_client
from yeto import codec
from yeto.island import Weights
from yeto.transport import PushReply, Received, Refused, ThetaStream, Transport

OUTER_LR = 0.7


class FlatWeights(Weights):
    """get/set only (like the MLX LoRA view): the island falls back to whole arrays."""

    def __init__(self, layout, init):
        self.layout, self.v = layout, init.copy()

    def get(self):
        return self.v.copy()

    def set(self, flat):
        self.v = np.array(flat, dtype=np.float32)


class RangedWeights(FlatWeights):
    """A numpy model with range access, counting flushes."""

    ranged = True
    flushes = 0

    def read_range(self, lo, hi):
        return self.v[lo:hi].copy()

    def write_range(self, lo, hi, values):
        self.v[lo:hi] = values

    def flush(self):
        self.flushes += 1


# ---- an in-memory syncer -------------------------------------------------------------
class FakeSyncer(Transport):
    """The Transport interface over a scripted syncer: Θ ← Θ − lr·decoded per push, the
    broadcast arriving `delay` steps later (at once to a waiting island); pushes whose seq
    is in `refuse` are refused. Records every payload."""

    address = "fake"

    def __init__(self, layout, fragments=1, delay=2, refuse=(), stream=None):
        self.layout = layout.with_fragments(fragments)
        self.num_fragments, self.delay, self.refuse = fragments, delay, set(refuse)
        self.stream = stream  # piece size: hand broadcasts over as ThetaStreams
        self.connected = threading.Event()
        self.connected.set()
        self.generation, self.acked_seq, self.fatal, self.last_error = 1, -1, None, None
        self.bytes_up = self.bytes_down = 0
        self.wait_s = 0.0
        self.clock = 0
        self.pending: list[tuple[int, Received]] = []
        self.payloads: list[bytes] = []
        self.version = {}


    def generation_for(self, fragment: int) -> int:
        return self.generation

    def acked_seq_for(self, fragment: int) -> int:
        return self.acked_seq
    def start(self, initial):
        self.theta = np.array(initial, dtype=np.float32)
        for f in range(self.num_fragments):
            self.version[f] = 0
            self._queue(f, final=False, due=0)

    def _queue(self, f, final, due):
        frag = self.layout.fragments[f]
        theta = self.theta[frag.start:frag.stop].copy()
        if self.stream:
            s = ThetaStream(theta.size, depth=1 << 20)
            for lo in range(0, theta.size, self.stream):
                s.put(theta[lo:lo + self.stream])
            s.end()
            theta = s
        self.pending.append((due, Received(self.version[f], f, final, theta)))

    def take(self):
        now = [r for due, r in self.pending if due <= self.clock]
        self.pending = [(d, r) for d, r in self.pending if d > self.clock]
        return now

    def wait(self, timeout=None, need_connection=False):
        if not self.pending:
            return []
        self.clock = max(self.clock, min(d for d, _ in self.pending))
        return self.take()

    def push(self, payload, *, encoding, base_version, loss_tokens, steps, seq, fragment=0,
             numel=None, train_loss=float("nan"), eval_loss=float("nan")):
        self.payloads.append(bytes(payload))
        fut = Future()
        if seq in self.refuse:
            fut.set_exception(Refused(f"push {seq} refused (scripted)"))
            return fut
        frag = self.layout.fragments[fragment]
        delta = codec.decode(payload, encoding, frag.numel)
        self.theta[frag.start:frag.stop] -= np.float32(OUTER_LR) * delta
        self.version[fragment] += 1
        self._queue(fragment, final=False, due=self.clock + self.delay)
        fut.set_result(PushReply(True, "accepted"))
        return fut

    def finish(self):
        for f in range(self.num_fragments):
            self._queue(f, final=True, due=self.clock)

    def close(self):
        pass


class HeldSyncer(FakeSyncer):
    """A FakeSyncer whose pushes the island hands over from its background thread
    (`background_pushes`), each held at the transport until `gate` is set (open by
    default): `entered` is set when a push reaches it. `wait` blocks, bounded, until a
    broadcast is due, as a real client's does."""

    background_pushes = True
    HOLD_S = 60.0  # the longest a push is held (a test that forgets to release fails)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cond = threading.Condition()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def push(self, payload, **kw):
        self.entered.set()
        if not self.gate.wait(self.HOLD_S):
            raise TimeoutError("the held push was never released")
        with self.cond:
            fut = super().push(payload, **kw)
            self.cond.notify_all()
        return fut

    def take(self):
        with self.cond:
            return super().take()

    def wait(self, timeout=None, need_connection=False):
        with self.cond:
            self.cond.wait_for(lambda: self.pending, timeout=min(timeout or self.HOLD_S,
                                                                 self.HOLD_S))
            return super().wait(timeout, need_connection)


def train_two_islands(addr, layout, make_island, steps: int = 12, timeout: float = 60.0):
    """Islands i0 and i1 against the syncer at `addr`, at once, each moving its weights
    from 0.1 toward its own index for up to `steps` steps, then finishing;
    `make_island(i, weights, client)` builds island i. Returns {i: (final weights,
    client)}."""
    done = {}

    def run(i):
        w = RangedWeights(layout, np.full(layout.numel, 0.1, np.float32))
        client = make_client(addr, f"i{i}", layout)
        isl = make_island(i, w, client)
        isl.start()
        for _ in range(steps):
            w.v -= np.float32(0.01) * (w.v - i)
            if isl.after_step(5):
                break
        isl.finish()
        done[i] = (w.v.copy(), client)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return done
