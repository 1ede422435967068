"""Wire codec throughput: q4 encode + decode against a plain numpy copy.

What is measured (all on one flat float32 vector, 64 MiB = 16M parameters by
default, best of N runs, measured round-robin in one process):

  baseline   `x.copy()`: a new float32 array with the same bytes. It allocates its
             output like `codec.decode` does, so both pay for fresh pages.
  q4         `codec.encode(x, "q4")` then `codec.decode(payload, "q4", n)`.
  f32, bf16  the same round trip, for context.

Throughputs are float32 input bytes per second (4 bytes per parameter) for every
row, so they compare directly. `ratio` = q4 round-trip throughput / copy
throughput. Goal: ratio >= 0.25, i.e. a q4 round trip costs at most four copies
of the f32 data.

Also shown: `decode_add` (numpy: acc += w * decode(p)), the syncer's sum of a q4
push with its norm as one compiled pass (`yeto.codec.kernels`, numba) against its
numpy twin (the same bits): `sum_speedup` in the RESULT line; a
copy into a preallocated array (no page faults) as a second reference point, and an
island's push encode (anchor − local plus the error-feedback residual, q4, the anchor
moved to local; each run first resets the anchor with one preallocated copy) on one
thread and on the island's default threads (`yeto.island.default_threads()`):
`push_threads_speedup` in the RESULT line.
"""

from __future__ import annotations

import numpy as np

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import MIB, interleaved, parser, rate, result_line

from yeto import codec
from yeto.codec import chunked, kernels
from yeto.display import print_table
from yeto.island.encoder import DeltaEncoder, default_threads
from yeto.island.island import CHUNK
from yeto.island.weights import WeightPasses, Weights
from yeto.layout import Layout


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0], "\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--mib", type=float, default=64, help="size of the f32 vector in MiB")
    p.add_argument("--repeat", type=int, default=None,
                   help="runs per measurement (default 10, 3 with --quick)")
    args = p.parse_args(argv)
    repeat = args.repeat or (3 if args.quick else 10)
    n = int(args.mib * MIB) // 4
    nbytes = 4 * n
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(x)
    acc = np.zeros_like(x)
    payload = {enc: codec.encode(x, enc) for enc in codec.ENCODINGS}

    fns = {"copy": lambda: x.copy(), "copyto": lambda: np.copyto(dst, x)}
    for enc in codec.ENCODINGS:
        fns[f"{enc}.encode"] = lambda enc=enc: codec.encode(x, enc)
        fns[f"{enc}.decode"] = lambda enc=enc: codec.decode(payload[enc], enc, n)
        fns[f"{enc}.decode_add"] = lambda enc=enc: codec.decode_add(payload[enc], enc, n, acc, 0.5)
    for name, backend in (("compiled", "auto"), ("numpy", "numpy")):
        fns[f"sum.{name}"] = lambda b=backend: syncer_sum(payload["q4"], n, acc, b)
    threads = default_threads()
    anchor0 = x + np.float32(0.01)
    islands = {k: push_encode(x, anchor0, k) for k in sorted({1, threads})}
    for k, push in islands.items():
        fns[f"push.{k}"] = push
    t = interleaved(fns, repeat)

    rows = [["copy (new array)", t["copy"] * 1e3, "", "", rate(nbytes, t["copy"]), 1.0],
            ["copyto (preallocated)", t["copyto"] * 1e3, "", "", rate(nbytes, t["copyto"]),
             t["copy"] / t["copyto"]]]
    ratios = {}
    for enc in codec.ENCODINGS:
        rt = t[f"{enc}.encode"] + t[f"{enc}.decode"]
        ratios[enc] = t["copy"] / rt
        rows.append([f"{enc} encode+decode", rt * 1e3, t[f"{enc}.encode"] * 1e3,
                     t[f"{enc}.decode"] * 1e3, rate(nbytes, rt), ratios[enc]])
    for enc in codec.ENCODINGS:
        td = t[f"{enc}.decode_add"]
        rows.append([f"{enc} decode_add", td * 1e3, "", "", rate(nbytes, td), t["copy"] / td])
    for name in ("compiled", "numpy"):
        ts = t[f"sum.{name}"]
        rows.append([f"syncer q4 sum + norm, {name}", ts * 1e3, "", "", rate(nbytes, ts),
                     t["copy"] / ts])
    for k in islands:
        tp = t[f"push.{k}"]
        rows.append([f"island push encode, {k} thread(s)", tp * 1e3, "", "", rate(nbytes, tp),
                     t["copy"] / tp])
    print(f"codec round trip of {nbytes / MIB:g} MiB f32 ({n:,} parameters), best of {repeat}; "
          "throughput in f32 MiB/s")
    headers = ["path", "ms", "encode ms", "decode ms", "MiB/s", "vs copy"]
    print_table(headers, rows, right=range(1, len(headers)))
    q4 = t["q4.encode"] + t["q4.decode"]
    print(result_line(ratios["q4"], goal=">=0.25", mib=nbytes / MIB,
                      q4_mib_s=rate(nbytes, q4), copy_mib_s=rate(nbytes, t["copy"]),
                      q4_encode_ms=t["q4.encode"] * 1e3, q4_decode_ms=t["q4.decode"] * 1e3,
                      q4_decode_add_ms=t["q4.decode_add"] * 1e3, copy_ms=t["copy"] * 1e3,
                      f32_ratio=ratios["f32"], bf16_ratio=ratios["bf16"],
                      sum_compiled_ms=t["sum.compiled"] * 1e3,
                      sum_numpy_ms=t["sum.numpy"] * 1e3,
                      sum_speedup=t["sum.numpy"] / t["sum.compiled"],
                      push_threads=threads,
                      push_threads_speedup=t["push.1"] / t[f"push.{threads}"]))
    return 0


def syncer_sum(payload, n: int, acc: np.ndarray, backend: str) -> None:
    """One push as the syncer sums it (acc += w · values, and its norm), by the compiled
    kernel (`backend` "auto"; without numba: the twin twice) or the numpy twin."""
    with kernels.using(backend):
        chunked.decode_add_norm(payload, "q4", n, acc, 0.5)


class _Local(Weights):
    """`local` as an island's weights with range access (writes go nowhere)."""

    ranged = True

    def __init__(self, local: np.ndarray):
        self.layout = Layout.from_shapes({"w": (local.size,)})
        self.local = local

    def get(self) -> np.ndarray:
        return self.local

    def set(self, flat: np.ndarray) -> None:
        pass

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        return self.local[lo:hi]

    def write_range(self, lo: int, hi: int, values: np.ndarray) -> None:
        pass


def push_encode(local: np.ndarray, anchor0: np.ndarray, threads: int):
    """An island's q4 push encode of `local` against `anchor0`, as a call: the island's
    delta encoder over a pass of its weights, from the anchor reset each time."""
    weights = _Local(local)
    encoder = DeltaEncoder(local.size, "q4", CHUNK, threads)
    encoder.anchor = np.empty_like(local)
    passes, frag = WeightPasses(weights), weights.layout.fragments[0]

    def push() -> None:
        np.copyto(encoder.anchor, anchor0)
        with passes.open() as w:
            encoder.encode(frag, w)

    return push


if __name__ == "__main__":
    raise SystemExit(main())
