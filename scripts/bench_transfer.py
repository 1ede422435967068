"""Transfer cost of the syncer path against raw gRPC bytes on loopback.

What is measured, in two processes as in a deployment: a server process holds the
syncer and the raw gRPC server (and, as `python -m syncer` does, two malloc arenas);
this process holds the clients. Apart, each has its own interpreter lock and its own
heap: in one process the client's lock and its trims of freed memory (`yeto.memory`)
slowed the syncer's side too, and raw sender and receiver shared one lock. The syncer
stamps when a push is in and when a broadcast is ready into shared memory
(`time.perf_counter` reads one system-wide clock on Linux and macOS).

  syncer   A real `syncer.run.Run` served by `syncer.service.serve`, one
           `yeto.client.SyncerClient` (quorum 1, so every push commits a round).
           Per round the client pushes a 64 MiB f32 pseudo-gradient (16M
           parameters); the syncer merges it, steps Θ and broadcasts Θ (f32) back.
             push       client.push() -> the syncer holds the whole payload
             broadcast  Θ published by the syncer -> Θ decoded on the client
             streamed   the same broadcast taken as islands take a large f32 one
                        (`stream_broadcasts`): each piece copied into the island's
                        weights as it arrives, no whole copy (`bcast_stream_ratio`)
             merge      the rest of the push call: validate, merge, outer step,
                        publish (compute, not transfer; shown for context)
  raw      A generic gRPC server beside the syncer, with identity serializers,
           streaming the same total as `bytes` messages: one client-streaming call
           up, one server-streaming call down (receivers only count bytes), in 1 MiB
           and in 4 MiB messages; each direction's baseline is the faster of the two
           (raw gRPC at its best, not at the syncer's size). Pushes and broadcasts
           through the syncer go in 1 MiB messages (`net.CHUNK_BYTES`).

  wire     The same syncer, with the island's side replaced by raw gRPC (identity
           serializers: pushes sent as prepared wire bytes, broadcasts counted, not
           parsed): what the syncer's own side costs, apart from the client's.

Raw and syncer rounds alternate: before each timed syncer round, one raw round (up,
then down) runs on the same warm raw server, so both see the same machine (it is
shared, and its speed drifts over seconds). Each path is compared with the best raw
round among its own rounds; the best of each is the figure, the median is shown.

`ratio` = raw (up + down) time / syncer (push + broadcast) time: what moving the
payload through the syncer's protocol costs against raw gRPC bytes (the design
says a transfer should cost about what raw bytes cost). Goal: ratio >= 0.7.
`push_ratio` and `bcast_ratio` split it by direction; `round_ratio` also counts
the merge (the whole round as an island sees it); `push_server_ratio` and
`bcast_server_ratio` are the wire rows. A q4 push of the same fragment is shown for
context, as parameters per second and the f32 bytes it stands for.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import statistics
import threading
import time
from concurrent import futures

import grpc
import numpy as np

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import MIB, parser, rate, result_line

from syncer.run import Config, Run
from syncer.service import serve
from yeto import codec, memory, net, wire
from yeto.client import SyncerClient
from yeto.display import print_table
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc
from yeto.transport import ThetaStream

RAW_SERVICE = "yetobench.Raw"
SYNCER = "/yeto.v1.Syncer/"


# ---- raw gRPC baseline ---------------------------------------------------------
# raw gRPC moves the bytes in messages of each of these sizes; the baseline of each
# direction is the faster one (the syncer's messages are 1 MiB: `net.CHUNK_BYTES`)
RAW_MESSAGE_BYTES = (1 << 20, 4 << 20)


def raw_pieces(total: int, size: int) -> list[bytes]:
    """`total` bytes as `size`-byte messages (the last one shorter)."""
    piece = np.random.default_rng(1).bytes(size)
    return [piece[:min(size, total - lo)] for lo in range(0, total, size)]


def raw_messages(total: int) -> dict[int, list[bytes]]:
    """`total` bytes at each of RAW_MESSAGE_BYTES: message size -> messages."""
    return {size: raw_pieces(total, size) for size in RAW_MESSAGE_BYTES}


def raw_server(total: int):
    """Up counts what it receives; Down sends `total` bytes in messages of the size its
    request names (8 bytes, little-endian)."""
    pieces = raw_messages(total)

    def up(request_iterator, context):
        n = 0
        for chunk in request_iterator:
            n += len(chunk)
        return n.to_bytes(8, "little")

    def down(request, context):
        yield from pieces[int.from_bytes(request, "little")]

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Up": grpc.stream_unary_rpc_method_handler(up),
        "Down": grpc.unary_stream_rpc_method_handler(down),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=net.GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def raw_up(channel, pieces: list[bytes]) -> int:
    return int.from_bytes(channel.stream_unary(f"/{RAW_SERVICE}/Up")(iter(pieces), timeout=600),
                          "little")


def raw_down(channel, size: int) -> int:
    n = 0
    for chunk in channel.unary_stream(f"/{RAW_SERVICE}/Down")(size.to_bytes(8, "little"),
                                                               timeout=600):
        n += len(chunk)
    return n


def raw_round(channel, messages: dict[int, list[bytes]], total) -> tuple[float, float]:
    """Seconds up and down for `total` bytes (`raw_messages`): at each message size,
    up then down, the fastest of each direction."""
    ups, downs = [], []
    for size, pieces in messages.items():
        t0 = time.perf_counter()
        got = raw_up(channel, pieces)
        t1 = time.perf_counter()
        n = raw_down(channel, size)
        t2 = time.perf_counter()
        assert got == total and n == total, (size, got, n, total)
        ups.append(t1 - t0)
        downs.append(t2 - t1)
    return min(ups), min(downs)


# ---- the syncer path -----------------------------------------------------------
class Probe:
    """Timestamps from inside the syncer's process, in shared memory (`stamps`:
    received, published). `time.perf_counter` is CLOCK_MONOTONIC on Linux, one
    clock for every process."""

    def __init__(self, run: Run, stamps):
        push, prepare = run.push, run.downlink.next

        def timed_push(h, payload, **kw):
            stamps[0] = time.perf_counter()
            return push(h, payload, **kw)

        def timed_prepare(*args, **kwargs):  # the broadcast is ready to stream
            broadcast = prepare(*args, **kwargs)
            stamps[1] = time.perf_counter()
            return broadcast

        run.push, run.downlink.next = timed_push, timed_prepare


def servers(total: int, conn, stamps) -> None:
    """The server process: the raw gRPC server and a syncer (quorum 1), as
    `python -m syncer` runs it (two malloc arenas); serves until `conn` says stop."""
    memory.limit_arenas()
    logging.basicConfig(level=logging.ERROR)
    raw, raw_port = raw_server(total)
    run = Run(Config(quorum=1, grace_ms=0, outer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                     max_staleness=1))
    Probe(run, stamps)
    server, port = serve(run, "127.0.0.1", 0)
    try:
        conn.send((raw_port, port))
        conn.recv()
    finally:
        server.ticker_stop.set()
        server.stop(grace=0).wait()
        raw.stop(grace=0).wait()
        run.tape.close()


def syncer_rounds(address: str, n: int, stamps, rounds: int, q4_rounds: int, raw,
                  warmup: int = 1):
    """Rounds of a buffered client (f32, then q4), of a client that streams broadcasts
    into its weights as islands do, then of the wire island; `raw()` (one raw round:
    up and down seconds) runs before each timed f32 round."""
    layout = Layout.from_shapes({"bench.weight": (n,)})
    rng = np.random.default_rng(0)
    rows, version = client_rounds(address, layout, stamps, rng, rounds, q4_rounds, raw,
                                  streamed=False, warmup=warmup)
    more, version = client_rounds(address, layout, stamps, rng, rounds, 0, raw,
                                  streamed=True, warmup=warmup)
    return rows + more + wire_rounds(address, layout, stamps, version, rounds, raw)


def client_rounds(address: str, layout: Layout, stamps, rng, rounds: int,
                  q4_rounds: int, raw, streamed: bool,
                  warmup: int = 1) -> tuple[list[dict], int]:
    """Push a pseudo-gradient and take the broadcast, per round. Buffered: Θ arrives
    whole, decoded; streamed (`stream_broadcasts`, what islands use for large f32
    broadcasts): each piece is copied into the island's weights as it arrives."""
    client = SyncerClient(address, "streamed" if streamed else "bench", layout, backoff_s=0.05)
    if streamed:
        client.stream_broadcasts()
    weights = np.empty(layout.numel, np.float32)
    rows = []
    try:
        client.start(rng.standard_normal(layout.numel, dtype=np.float32))
        first = client.wait_one(timeout=300)
        if first is None:
            raise RuntimeError(f"no first broadcast from the syncer: {client.fatal}")
        _take(first.theta, weights)
        version = first.version
        # warm-up rounds (untimed): first-touch page faults of fresh buffers, on a VM
        # also the host backing guest memory, cost more than the transfer itself
        for r in range(warmup + rounds + q4_rounds):
            enc = "f32" if r < warmup + rounds else "q4"
            payload = codec.encode(rng.standard_normal(layout.numel, dtype=np.float32) * 1e-3,
                                   enc)
            base = raw() if r >= warmup and enc == "f32" else (None, None)
            t0 = time.perf_counter()
            reply = client.push(payload, encoding=enc, base_version=version, loss_tokens=100,
                                steps=1, seq=r).result(timeout=300)
            t_reply = time.perf_counter()
            got = client.wait_one(timeout=300)
            if got is not None:
                _take(got.theta, weights)
            t_got = time.perf_counter()
            if not reply.accepted or got is None or got.version != version + 1:
                raise RuntimeError(f"round {r} went wrong: {reply}, {got}")
            version = got.version
            if r >= warmup:
                rows.append({"enc": "stream" if streamed else enc, "bytes": len(payload),
                             "push": stamps[0] - t0, "push_rpc": t_reply - t0,
                             "bcast": t_got - stamps[1], "total": t_got - t0,
                             "raw_up": base[0], "raw_down": base[1]})
            del payload, got
    finally:
        client.close()
    return rows, version


def _take(theta, weights: np.ndarray) -> None:
    """A streamed broadcast copied into `weights` piece by piece (as an island applies
    it); a buffered one is already whole and decoded."""
    if isinstance(theta, ThetaStream):
        lo = 0
        for piece in theta.pieces():
            weights[lo:lo + piece.size] = piece
            lo += piece.size


class WireIsland:
    """An island that speaks the syncer's protocol as raw gRPC bytes: pushes are
    prepared wire bytes, broadcasts are counted (only each header chunk is parsed)."""

    def __init__(self, address: str, layout: Layout):
        self.channel = grpc.insecure_channel(address, options=net.GRPC_OPTIONS)
        stub = pb_grpc.SyncerStub(self.channel)
        join = stub.Join(pb.JoinRequest(
            learner_id="wire", fingerprint=layout.fingerprint,
            layout=[pb.TensorSpec(name=x.name, shape=list(x.shape), dtype=x.dtype)
                    for x in layout.specs]), timeout=60)
        self.generation, self.numel = join.generation, layout.numel
        self.done: dict[int, float] = {}  # version -> when its last byte arrived
        self.cond = threading.Condition()
        self._push = self.channel.stream_unary(SYNCER + "Push", request_serializer=bytes,
                                               response_deserializer=pb.PushReply.FromString)
        listen = self.channel.unary_stream(
            SYNCER + "Subscribe", request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=bytes)
        self._stream = listen(pb.SubscribeRequest(learner_id="wire", generation=self.generation))
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        left, version = 0, -1
        try:
            for raw in self._stream:
                if left == 0:  # a header chunk: parse it (one per broadcast)
                    head = pb.BroadcastChunk.FromString(raw)
                    left, version = head.header.payload_bytes, head.header.version
                    left -= len(head.data)
                else:  # a data chunk (field 2 only): its length without a copy
                    left -= len(wire.parse_push_chunk(raw).data)
                if left <= 0:
                    with self.cond:
                        self.done[version] = time.perf_counter()
                        self.cond.notify_all()
                    left = 0
        except grpc.RpcError:
            pass

    def prepare(self, payload: bytes, version: int, seq: int) -> list[bytes]:
        h = pb.PushHeader(learner_id="wire", generation=self.generation, round=version + 1,
                          base_version=version, loss_tokens=100, steps=1, encoding="f32",
                          numel=self.numel, payload_bytes=len(payload), kind=pb.DELTA, seq=seq)
        return [pb.PushChunk(header=h if i == 0 else None, data=bytes(piece)).SerializeToString()
                for i, piece in enumerate(net.chunks(payload, net.CHUNK_BYTES))]

    def push(self, chunks: list[bytes]) -> pb.PushReply:
        return self._push(iter(chunks), timeout=300)

    def wait(self, version: int) -> float:
        with self.cond:
            self.cond.wait_for(lambda: version in self.done, timeout=300)
            return self.done[version]

    def close(self) -> None:
        self._stream.cancel()
        self.channel.close()


def wire_rounds(address: str, layout: Layout, stamps, version: int, rounds: int,
                raw, warmup: int = 1) -> list[dict]:
    """Rounds of the wire island alone (the client island has left)."""
    isl = WireIsland(address, layout)
    rng = np.random.default_rng(1)
    rows = []
    try:
        isl.wait(version)
        for r in range(warmup + rounds):
            chunks = isl.prepare(codec.encode(rng.standard_normal(layout.numel, dtype=np.float32)
                                              * 1e-3, "f32"), version, seq=r)
            base = raw() if r >= warmup else (None, None)
            t0 = time.perf_counter()
            if not isl.push(chunks).accepted:
                raise RuntimeError(f"wire round {r}: push refused")
            got = isl.wait(version + 1)
            version += 1
            if r >= warmup:
                rows.append({"enc": "wire", "push": stamps[0] - t0,
                             "bcast": got - stamps[1], "raw_up": base[0],
                             "raw_down": base[1]})
    finally:
        isl.close()
    return rows


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0], "\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--mib", type=float, default=64, help="f32 fragment size in MiB")
    p.add_argument("--rounds", type=int, default=None,
                   help="f32 rounds for each path (default 5, 2 with --quick)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rounds = args.rounds or (2 if args.quick else 5)
    n = int(args.mib * MIB) // 4
    total = 4 * n

    spawn = mp.get_context("spawn")  # gRPC does not survive fork
    stamps, (conn, child_conn) = spawn.Array("d", 2, lock=False), spawn.Pipe()
    child = spawn.Process(target=servers, args=(total, child_conn, stamps), daemon=True)
    child.start()
    child_conn.close()  # the child's end: if it dies, recv() ends instead of waiting
    try:
        try:
            raw_port, port = conn.recv()
        except EOFError:
            raise SystemExit("the server process died before it listened (see above)") from None
        messages = raw_messages(total)
        with grpc.insecure_channel(f"127.0.0.1:{raw_port}", options=net.GRPC_OPTIONS) as ch:
            raw_round(ch, messages, total)  # warm-up (untimed): connection, allocations
            rows = syncer_rounds(f"127.0.0.1:{port}", n, stamps, rounds,
                                 1 if args.quick else 2,
                                 raw=lambda: raw_round(ch, messages, total))
    finally:
        if child.is_alive():
            conn.send("stop")
        child.join(timeout=60)
    report(rows, n, rounds)
    return 0


def report(rows: list[dict], n: int, rounds: int) -> None:
    """The table and the RESULT line: each path against the raw rounds run among its
    own rounds (a q4 push against the f32 rounds')."""
    total = 4 * n
    by = {k: [r for r in rows if r["enc"] == k] for k in ("f32", "q4", "wire", "stream")}
    timed = [r for r in rows if r["raw_up"] is not None]  # every raw round

    def best(key, rs):
        return min(r[key] for r in rs)

    def median_ms(key, rs):
        return f"({statistics.median(r[key] for r in rs) * 1e3:.0f})"

    def row(name, key, kind):
        rs, base = by[kind], by["f32" if kind == "q4" else kind]
        t = best(key, rs)
        raw_t = best("raw_up" if key == "push" else "raw_down", base)
        return [name, t * 1e3, median_ms(key, rs), rate(total, t), raw_t / t]

    f32 = by["f32"]
    up, down = best("raw_up", f32), best("raw_down", f32)
    push, bcast, total_s = best("push", f32), best("bcast", f32), best("total", f32)
    merge = min(r["push_rpc"] - r["push"] for r in f32)
    ratio = (up + down) / (push + bcast)
    print(f"{total / MIB:g} MiB f32 fragment ({n:,} parameters) over loopback gRPC, best of "
          f"{rounds} rounds (median), each after a raw round; MiB/s of payload")
    tab = [[f"raw gRPC {d} (1 or 4 MiB messages)", best(k, timed) * 1e3, median_ms(k, timed),
            rate(total, best(k, timed)), ""] for d, k in (("up", "raw_up"), ("down", "raw_down"))]
    tab += [
        row("syncer push", "push", "f32"),
        row("syncer broadcast", "bcast", "f32"),
        row("syncer broadcast, streamed into weights", "bcast", "stream"),
        ["syncer push + broadcast", (push + bcast) * 1e3, "", rate(2 * total, push + bcast),
         ratio],
        ["  merge+step+publish", merge * 1e3, "", "", ""],
        ["  whole round", total_s * 1e3, median_ms("total", f32), rate(2 * total, total_s),
         (up + down) / total_s],
        row("q4 push (f32-equivalent)", "push", "q4"),
        row("wire: syncer push (raw writer)", "push", "wire"),
        row("wire: syncer broadcast (raw reader)", "bcast", "wire"),
    ]
    headers = ["path", "ms", "median", "MiB/s", "raw/this"]
    print_table(headers, tab, right=range(1, len(headers)))
    q4_push = best("push", by["q4"])
    print(result_line(ratio, goal=">=0.7", mib=total / MIB,
                      push_ratio=tab[2][4], bcast_ratio=tab[3][4], bcast_stream_ratio=tab[4][4],
                      push_server_ratio=tab[9][4], bcast_server_ratio=tab[10][4],
                      round_ratio=(up + down) / total_s,
                      raw_up_mib_s=rate(total, up), raw_down_mib_s=rate(total, down),
                      push_mib_s=rate(total, push), bcast_mib_s=rate(total, bcast),
                      merge_ms=merge * 1e3, q4_push_mparams_s=n / 1e6 / q4_push,
                      q4_payload_mib=by["q4"][0]["bytes"] / MIB))


if __name__ == "__main__":
    raise SystemExit(main())
