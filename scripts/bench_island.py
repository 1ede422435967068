"""Island overhead: tokens/s of a torch island syncing with a real syncer ÷ a bare
peft training loop on the same model and data, measured in the same run.

Both arms run in this process with the same threads, model, LoRA config, batches
and AdamW; the island arm adds `yeto.island.Island` (push every --sync-every
steps, q4 wire, error feedback) against a real syncer subprocess (quorum 1).
Arms alternate (bare, island, bare, island) and each arm's tokens/s is the mean
of its runs. Also measured: the time the island waits on the network per round,
as a share of round time (goal <= 1%). Goal for the ratio: >= 0.97 on the tiny model.

Last line: RESULT ratio=<tokens/s ratio> cpu_ratio=<ratio> wait_share=<share> ...
where cpu_ratio is the same ratio of tokens per CPU second of the process (all its
threads: the island's background encode counts, the syncer's process does not): on a
machine shared with other jobs it shows what the island costs apart from the
contention.

With --nproc N it measures instead an island made of a torchrun group: tokens/s
of `torchrun --nproc-per-node N -m yeto.learner` ÷ N × a 1-process island, both
run in this invocation as subprocesses on the same model and data (single-island
mode, so only the group's own all-reduce and weight broadcasts are measured).
Last line then: RESULT ratio=<tokens/s(N) / (N × tokens/s(1))> nproc=N ...

With --backend mlx it measures the MLX island the same way against a bare mlx-lm
LoRA loop (mlx-lm's own `linear_to_lora_layers` on the same linears, AdamW, the
same batches and weighted loss): RESULT ratio=<island / bare> cpu_ratio=...
(mlx's Linux CPU build runs on one thread; --threads sets torch's.)

Every arm of both backends trains LoRA rank 16, alpha 32 on every linear of every
decoder block ("all-linear"), with the same --batch-size, --seq-len and --threads.

The model: by default a tiny llama built in the process, on a synthetic task. With
--model FILE.gguf|DIR, a real checkpoint (a GGUF file is read once into a cached
float32 model dir, as the islands read it: `yeto.data.models.resolve_model`) on real
text: the standard library's docstrings (`yeto.testing.real.stdlib_docs`). The goals
on a real model are >= 0.95 (torch) and >= 0.9 (MLX). SmolLM2-135M-Instruct:

    python -m yeto.testing.real --fetch     # prints the GGUF file's path
    python scripts/bench_island.py --model PATH.gguf --batch-size 2 --seq-len 128 \\
        --steps 8 --sync-every 3
    python scripts/bench_island.py --backend mlx --model PATH.gguf --batch-size 2 \\
        --seq-len 128 --steps 6 --sync-every 2
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
from yeto.client import SyncerClient  # noqa: E402
from yeto.data import BatchSampler, load_blocks  # noqa: E402
from yeto.display import print_table  # noqa: E402
from yeto.island import FlatWeights, Island  # noqa: E402
from yeto.testing.tasks import make_task  # noqa: E402
from yeto.testing.tiny import make_tiny_model  # noqa: E402
from yeto.torch.loss import train_step  # noqa: E402
from yeto.torch.model import attach_lora, load_base  # noqa: E402
from yeto.torch.weights import TorchWeights  # noqa: E402

#: every arm's LoRA: rank, alpha, `--lora-targets` (mlx-lm's scale is alpha / rank)
LORA_R, LORA_ALPHA, LORA_TARGETS = 16, 32, "all-linear"
#: the linears of a llama-style decoder block (mlx-lm's names): the bare mlx-lm
#: loop's LoRA keys, what "all-linear" chooses in such a block
BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TINY_GOAL, REAL_GOALS = 0.97, {"torch": 0.95, "mlx": 0.9}


def setup(model_dir: Path, train: Path, seq_len: int):
    model, tok = load_base(str(model_dir))
    model = attach_lora(model, LORA_R, LORA_ALPHA, LORA_TARGETS, seed=0).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    blocks = load_blocks(train, tok, seq_len)
    return model, opt, blocks


PUSHES: dict[str, list[float]] = dict(blocked=[], encode=[])


class Timed:
    """The timed loop of one arm run: wall and process CPU seconds (all its threads),
    and the island's pushes made meanwhile."""

    def __init__(self, island):
        self.island = island
        self.pushes0 = (len(island.blocked_s), len(island.ledger.encode_s)) if island else None
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def done(self, tokens: int) -> tuple[float, float, float]:
        """(tokens/s, network wait share, tokens per CPU second); closes the island's
        client and adds its timed pushes to `PUSHES`."""
        elapsed = time.perf_counter() - self.t0
        cpu = time.process_time() - self.c0
        wait = 0.0
        if self.island is not None:
            wait = self.island.client.wait_s / elapsed
            PUSHES["blocked"] += self.island.blocked_s[self.pushes0[0]:]
            PUSHES["encode"] += self.island.ledger.encode_s[self.pushes0[1]:]
            self.island.client.close()
        return tokens / elapsed, wait, tokens / cpu


def run_arm(model_dir, train, args, syncer_addr: str | None) -> tuple[float, float, float]:
    """Returns (tokens/s, wait share, tokens per CPU second); the island arm adds, in
    `PUSHES`, each timed push's seconds the training loop waited for it and its
    background encode's."""
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
    tokens, timed = 0, Timed(island)
    for _ in range(args.steps):
        mb = next(sampler)
        _, loss_tokens = train_step(model, opt, [mb], args.device)
        tokens += mb[0].shape[0] * (mb[0].shape[1] - 1)
        if island is not None:
            island.after_step(loss_tokens)
    return timed.done(tokens)


def mlx_arm(model_dir: Path, train: Path, args,
            syncer_addr: str | None) -> tuple[float, float, float]:
    """`run_arm`'s figures for the yeto MLX island (with a syncer), or for a bare mlx-lm
    LoRA loop."""
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
        from mlx_lm.tuner.lora import LoRALinear
        from mlx_lm.tuner.utils import linear_to_lora_layers

        model, _ = mlx_lm.load(str(model_dir))
        model.freeze()
        linear_to_lora_layers(model, len(model.layers), {
            "rank": LORA_R, "scale": LORA_ALPHA / LORA_R, "dropout": 0.0,
            "keys": list(BLOCK_LINEARS)})
        adapted = sum(1 for _, m in model.named_modules() if isinstance(m, LoRALinear))
        if adapted != len(BLOCK_LINEARS) * len(model.layers):
            raise SystemExit(f"the bare mlx-lm loop adapted {adapted} linears, not "
                             f"{len(BLOCK_LINEARS)} in each of {len(model.layers)} blocks: "
                             f"it knows llama-style blocks only ({', '.join(BLOCK_LINEARS)})")

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
        model, _, layers = build_lora_model(model_dir, LORA_R, LORA_ALPHA, LORA_TARGETS, 0)
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
    tokens, timed = 0, Timed(island)
    for _ in range(args.steps):
        mb = next(sampler)
        step(mb)
        tokens += mb[0].shape[0] * (mb[0].shape[1] - 1)
    return timed.done(tokens)


def prepare(args, tmp: Path) -> tuple[Path, Path, str]:
    """(model dir, train.jsonl, the model's name): --model's checkpoint and the standard
    library's docstrings, or the tiny llama and its synthetic task."""
    if args.model is None:
        return make_tiny_model(tmp / "model", "llama"), make_task(tmp / "data")[0], "tiny"
    from yeto.data.models import resolve_model
    from yeto.testing.real import stdlib_docs

    (tmp / "data").mkdir()
    name = Path(args.model).name.split(".")[0]
    return resolve_model(args.model).path, stdlib_docs(tmp / "data")[0], name


def alternate_arms(arm, args) -> dict[str, float]:
    """Bare and island runs of `arm(model_dir, train, args, syncer or None)`, alternated
    against one syncer subprocess; returns the means over the runs: bare, island (tokens
    /s), wait (the island's network wait share), bare_cpu, island_cpu (tokens per CPU
    second of the process)."""
    runs: dict[str, list[float]] = dict(bare=[], island=[], wait=[], bare_cpu=[],
                                        island_cpu=[])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir, train, args.model_name = prepare(args, tmp)
        with start_syncer(["--quorum", "1", "--log-level", "WARNING"], cwd=ROOT,
                          log=tmp / "syncer.log") as syncer:
            for r in range(args.repeats):
                tps, _, cpu = arm(model_dir, train, args, None)
                runs["bare"].append(tps)
                runs["bare_cpu"].append(cpu)
                tps, wait, cpu = arm(model_dir, train, args, syncer.address)
                runs["island"].append(tps)
                runs["wait"].append(wait)
                runs["island_cpu"].append(cpu)
                print(f"run {r + 1}/{args.repeats}: bare {runs['bare'][-1]:.1f} tok/s, "
                      f"island {tps:.1f} tok/s", flush=True)
    return {k: sum(v) / len(v) for k, v in runs.items()}


def table(args, bare_name: str, island_name: str, m: dict[str, float]) -> None:
    print_table(["arm", "tokens/s", "tokens per CPU s"],
                [[bare_name, f"{m['bare']:.1f}", f"{m['bare_cpu']:.1f}"],
                 [f"{island_name}, sync every {args.sync_every}", f"{m['island']:.1f}",
                  f"{m['island_cpu']:.1f}"]], right=[1, 2])


def goal(args) -> float:
    return TINY_GOAL if args.model is None else REAL_GOALS[args.backend]


def push_medians() -> tuple[float, float, int]:
    """Medians over the island runs' pushes: (seconds the loop waited, encode seconds,
    how many pushes)."""
    blocked = statistics.median(PUSHES["blocked"] or [float("nan")])
    encode = statistics.median(PUSHES["encode"] or [float("nan")])
    return blocked, encode, len(PUSHES["blocked"])


def sizes(args) -> str:
    return (f"model={args.model_name} batch={args.batch_size} seq_len={args.seq_len} "
            f"threads={args.threads} steps={args.steps} sync_every={args.sync_every} "
            f"repeats={args.repeats}")


def bench_mlx(args) -> int:
    if args.quick:  # MLX on a CPU is slow: fewer steps, and still a few syncs among them
        args.steps, args.sync_every = min(args.steps, 20), min(args.sync_every, 10)
    m = alternate_arms(mlx_arm, args)
    table(args, "bare mlx-lm LoRA loop", "yeto MLX island", m)
    blocked, encode, pushes = push_medians()
    print(f"RESULT ratio={m['island'] / m['bare']:.4f} "
          f"cpu_ratio={m['island_cpu'] / m['bare_cpu']:.4f} wait_share={m['wait']:.5f} "
          f"island_blocked_s={blocked:.4f} encode_s={encode:.4f} pushes={pushes} backend=mlx "
          f"goal_ratio=>={goal(args)} bare_tok_s={m['bare']:.1f} "
          f"island_tok_s={m['island']:.1f} {sizes(args)}")
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
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every torch arm (mlx's CPU build uses one)")
    p.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    p.add_argument("--model", default=None, metavar="FILE.gguf|DIR",
                   help="a real checkpoint, trained on the standard library's docstrings "
                        "(default: a tiny llama on a synthetic task, built in the process)")
    p.add_argument("--nproc", type=int, default=0,
                   help="measure a torchrun island of N processes instead (see above)")
    p.add_argument("--quick", action="store_true", help="100 steps, 1 run per arm (< 30 s)")
    p.add_argument("--device", default="cpu", help="torch arms: cpu, cuda or cuda:N")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 100, 1
    if args.model is not None and not Path(args.model).exists():
        raise SystemExit(f"--model {args.model}: not found (SmolLM2-135M-Instruct's GGUF "
                         "file: python -m yeto.testing.real --fetch)")
    if args.model is not None and args.nproc > 1:
        raise SystemExit("--model: --nproc measures the tiny model only")
    if args.nproc > 1:
        return bench_group(args)
    if args.backend == "mlx":
        return bench_mlx(args)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    m = alternate_arms(run_arm, args)
    table(args, "bare peft loop", "island", m)
    print(f"network wait: {100 * m['wait']:.3f}% of the island's time")
    blocked, encode, pushes = push_medians()
    print(f"a push: the training loop waited {blocked:.4f} s for it, its encode took "
          f"{encode:.4f} s in the background (medians of {pushes})")
    print(f"RESULT ratio={m['island'] / m['bare']:.4f} "
          f"cpu_ratio={m['island_cpu'] / m['bare_cpu']:.4f} wait_share={m['wait']:.5f} "
          f"island_blocked_s={blocked:.4f} encode_s={encode:.4f} pushes={pushes} "
          f"device={args.device} goal_ratio=>={goal(args)} goal_wait=<=0.01 "
          f"bare_tok_s={m['bare']:.1f} island_tok_s={m['island']:.1f} {sizes(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
