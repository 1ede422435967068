"""Island overhead: tokens/s of a torch island syncing with a real syncer ÷ a bare
peft training loop on the same model and data, measured in the same run.

Both arms run in this process with the same threads, model, LoRA config, batches
and AdamW; the island arm adds `yeto.island.Island` (push every --sync-every
steps, q4 wire, error feedback) against a real syncer subprocess (quorum 1).
Arms alternate (bare, island, bare, island) and each arm's tokens/s is the mean
of its runs. Also measured: the time the island waits on the network per round,
as a share of round time (goal <= 1%). Goal for the ratio: >= 0.97.

Last line: RESULT ratio=<tokens/s ratio> wait_share=<share> ...

With --nproc N it measures instead an island made of a torchrun group: tokens/s
of `torchrun --nproc-per-node N -m yeto.learner` ÷ N × a 1-process island, both
run in this invocation as subprocesses on the same model and data (single-island
mode, so only the group's own all-reduce and weight broadcasts are measured).
Last line then: RESULT ratio=<tokens/s(N) / (N × tokens/s(1))> nproc=N ...

With --backend mlx it measures the MLX island the same way against a bare mlx-lm
LoRA loop (mlx-lm's own `linear_to_lora_layers` on the same linears, AdamW, the
same batches and weighted loss): RESULT ratio=<island / bare> wait_share=...
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from syncer.spawn import start_syncer  # noqa: E402
from yeto.cli.display import print_table  # noqa: E402
from yeto.client import SyncerClient  # noqa: E402
from yeto.data import BatchSampler, load_blocks  # noqa: E402
from yeto.island import FlatWeights, Island  # noqa: E402
from yeto.testing.tasks import make_task  # noqa: E402
from yeto.testing.tiny import make_tiny_model  # noqa: E402
from yeto.torch.loss import train_step  # noqa: E402
from yeto.torch.model import attach_lora, load_base  # noqa: E402
from yeto.torch.weights import TorchWeights  # noqa: E402


def setup(model_dir: Path, train: Path, seq_len: int):
    model, tok = load_base(str(model_dir))
    model = attach_lora(model, 16, 32, "auto", seed=0).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    blocks = load_blocks(train, tok, seq_len)
    return model, opt, blocks


PUSHES: dict[str, list[float]] = dict(blocked=[], encode=[])


def run_arm(model_dir, train, args, syncer_addr: str | None) -> tuple[float, float]:
    """Returns (tokens/s, wait share); the island arm adds, in `PUSHES`, each push's
    seconds the training loop waited for it and its background encode's."""
    model, opt, blocks = setup(model_dir, train, args.seq_len)
    model.to(args.device)
    sampler = BatchSampler(blocks, args.batch_size, seed=0)
    weights = TorchWeights(model, "lora")
    island = None
    if syncer_addr:
        client = SyncerClient(syncer_addr, f"bench-{time.monotonic_ns()}", weights.layout)
        island = Island(weights, client=client, sync_every=args.sync_every, wire="q4")
        # the guard before each optimizer step, as the torch learner installs it
        island.guard_updates(lambda before: bool(opt.register_step_pre_hook(
            lambda *_: before())))
        island.start()
    for _ in range(3):  # warm-up, not timed
        train_step(model, opt, [next(sampler)], args.device)
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        mb = next(sampler)
        _, loss_tokens = train_step(model, opt, [mb], args.device)
        tokens += mb[0].shape[0] * (mb[0].shape[1] - 1)
        if island is not None:
            island.after_step(loss_tokens)
    elapsed = time.perf_counter() - t0
    wait_share = 0.0
    if island is not None:
        wait_share = island.client.wait_s / elapsed
        PUSHES["blocked"] += island.blocked_s
        PUSHES["encode"] += island.ledger.encode_s
        island.client.close()
    return tokens / elapsed, wait_share


def mlx_arm(model_dir: Path, train: Path, args, syncer_addr: str | None) -> tuple[float, float]:
    """tokens/s of the yeto MLX island (with a syncer), or of a bare mlx-lm LoRA loop."""
    import mlx.core as mx
    import mlx.nn as nn
    from transformers import AutoTokenizer

    from yeto.mlx.learner import build_lora_model, make_loss_and_grad, make_optimizer
    from yeto.mlx.learner import train_step as mlx_step
    from yeto.mlx.lora import LoRAWeights

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sampler = BatchSampler(load_blocks(train, tok, args.seq_len, packing="naive"),
                           args.batch_size, seed=0)
    opt = make_optimizer(1e-3, 0.0)
    island = None
    if syncer_addr is None:  # mlx-lm's own LoRA layers on every linear of every block
        import mlx_lm
        from mlx_lm.tuner.utils import linear_to_lora_layers

        model, _ = mlx_lm.load(str(model_dir))
        model.freeze()
        keys = [f"{a}.{b}" for a, bs in (("self_attn", ("q_proj", "k_proj", "v_proj",
                                                       "o_proj")),
                                         ("mlp", ("gate_proj", "up_proj", "down_proj")))
                for b in bs]
        linear_to_lora_layers(model, len(model.layers), {"rank": 16, "scale": 2.0,
                                                          "dropout": 0.0, "keys": keys})

        def loss_fn(m, tokens, weights):
            logits = m(tokens[:, :-1]).astype(mx.float32)
            ce = nn.losses.cross_entropy(logits, tokens[:, 1:])
            return (ce * weights).sum() / mx.maximum(weights.sum(), 1.0)

        value_and_grad = nn.value_and_grad(model, loss_fn)

        def step(mb):
            loss, grads = value_and_grad(model, mx.array(mb[0]), mx.array(mb[1]))
            opt.update(model, grads)
            mx.eval(model.trainable_parameters(), opt.state, loss)
            return int((mb[1] > 0).sum())
    else:
        model, _, layers = build_lora_model(model_dir, 16, 32, "all-linear", 0)
        loss_and_grad = make_loss_and_grad(model)
        weights = LoRAWeights(layers)
        client = SyncerClient(syncer_addr, f"bench-mlx-{time.monotonic_ns()}", weights.layout)
        island = Island(FlatWeights(weights.layout, weights.get, weights.set), client=client,
                        sync_every=args.sync_every, wire="q4")
        island.guard_updates(lambda before: True)  # `mlx_step` calls it before the update
        island.start()

        def step(mb):
            _, loss_tokens = mlx_step(model, opt, [mb], loss_and_grad, island.before_update)
            island.after_step(loss_tokens)
            return loss_tokens
    for _ in range(2):  # warm-up, not timed
        step(next(sampler))
    tokens, t0 = 0, time.perf_counter()
    for _ in range(args.steps):
        mb = next(sampler)
        step(mb)
        tokens += mb[0].shape[0] * (mb[0].shape[1] - 1)
    elapsed = time.perf_counter() - t0
    wait = 0.0
    if island is not None:
        wait = island.client.wait_s / elapsed
        island.client.close()
    return tokens / elapsed, wait


def alternate_arms(arm, args) -> tuple[float, float, float]:
    """Bare and island runs of `arm(model_dir, train, args, syncer or None)`, alternated
    against one syncer subprocess; returns mean (bare tok/s, island tok/s, wait share)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_model(tmp / "model", "llama")
        train, _ = make_task(tmp / "data")
        with start_syncer(["--quorum", "1", "--log-level", "WARNING"], cwd=ROOT,
                          log=tmp / "syncer.log") as syncer:
            bare, isl, waits = [], [], []
            for _ in range(args.repeats):
                bare.append(arm(model_dir, train, args, None)[0])
                tps, wait = arm(model_dir, train, args, syncer.address)
                isl.append(tps)
                waits.append(wait)
    return sum(bare) / len(bare), sum(isl) / len(isl), sum(waits) / len(waits)


def bench_mlx(args) -> int:
    if args.quick:  # MLX on a CPU is slow: fewer steps, and still a few syncs among them
        args.steps, args.sync_every = min(args.steps, 20), min(args.sync_every, 10)
    b, i, w = alternate_arms(mlx_arm, args)
    print_table(["arm", "tokens/s"], [["bare mlx-lm LoRA loop", f"{b:.0f}"],
                                      [f"yeto MLX island, sync every {args.sync_every}",
                                       f"{i:.0f}"]], right=[1])
    print(f"RESULT ratio={i / b:.4f} wait_share={w:.5f} backend=mlx goal_ratio=>=0.97 "
          f"bare_tok_s={b:.0f} island_tok_s={i:.0f} steps={args.steps}")
    return 0


def bench_group(args) -> int:
    import json

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_model(tmp / "model", "llama")
        train, _ = make_task(tmp / "data")
        common = ["-m", "yeto.learner", "--model", str(model_dir), "--data", str(train),
                  "--syncer", "none", "--max-steps", str(args.steps), "--seq-len",
                  str(args.seq_len), "--batch-size", str(args.batch_size), "--threads",
                  str(args.threads), "--no-progress", "--log-level", "WARNING"]
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        rates = {1: [], args.nproc: []}
        for r in range(args.repeats):
            for n, launcher in ((1, [sys.executable]),
                                (args.nproc, [torchrun, "--nproc-per-node", str(args.nproc),
                                              "--master-port", str(29600 + r)])):
                out = tmp / f"out-{n}-{r}"
                subprocess.run([*launcher, *common, "--output", str(out)], cwd=ROOT, check=True)
                rates[n].append(json.loads((out / "summary.json").read_text())["tokens_per_s"])
    one = sum(rates[1]) / len(rates[1])
    many = sum(rates[args.nproc]) / len(rates[args.nproc])
    print_table(["island", "tokens/s"], [["1 process", f"{one:.0f}"],
                                         [f"torchrun, {args.nproc} processes", f"{many:.0f}"]],
                right=[1])
    print(f"RESULT ratio={many / (args.nproc * one):.4f} nproc={args.nproc} "
          f"one_tok_s={one:.0f} group_tok_s={many:.0f} threads_per_process={args.threads} "
          f"steps={args.steps} cores={os.cpu_count()}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="timed steps per arm run")
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="runs per arm (alternating)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    p.add_argument("--nproc", type=int, default=0,
                   help="measure a torchrun island of N processes instead (see above)")
    p.add_argument("--quick", action="store_true", help="100 steps, 1 run per arm (< 30 s)")
    p.add_argument("--device", default="cpu", help="torch arms: cpu, cuda or cuda:N")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 100, 1
    if args.nproc > 1:
        return bench_group(args)
    if args.backend == "mlx":
        return bench_mlx(args)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    b, i, w = alternate_arms(run_arm, args)
    print_table(["arm", "tokens/s"], [["bare peft loop", f"{b:.0f}"],
                                      [f"island, sync every {args.sync_every}", f"{i:.0f}"]],
                right=[1])
    print(f"network wait: {100 * w:.3f}% of the island's time")
    blocked = statistics.median(PUSHES["blocked"] or [float("nan")])
    encode = statistics.median(PUSHES["encode"] or [float("nan")])
    print(f"a push: the training loop waited {blocked:.4f} s for it, its encode took "
          f"{encode:.4f} s in the background (medians of {len(PUSHES['blocked'])})")
    print(f"RESULT ratio={i / b:.4f} wait_share={w:.5f} island_blocked_s={blocked:.4f} "
          f"encode_s={encode:.4f} device={args.device} goal_ratio=>=0.97 goal_wait=<=0.01 "
          f"bare_tok_s={b:.0f} island_tok_s={i:.0f} steps={args.steps} "
          f"sync_every={args.sync_every} repeats={args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
