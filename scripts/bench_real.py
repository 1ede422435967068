"""A real pretrained model: a federated LoRA run of two torch islands against a
bare single-process peft LoRA loop on the same tokens, and the islands' tokens/s against
the bare loop's, all measured in the same run.

What is measured, on SmolLM2-135M-Instruct (the GGUF file of `yeto.testing.real.SMOLLM2`,
read once into a float32 model dir by `yeto.gguf`) and real text (the Python standard
library's docstrings, `yeto.testing.real.stdlib_docs`: train and held-out rows come from
different modules):

  yeto       `yeto launch --islands torch,torch`: a syncer (its default outer rule) and two
             torch islands, each on its half of the training rows, N steps each, a push
             every H steps; one torch thread per island. The final adapter is what a user
             gets: `yeto export --state-dir OUT/yeto/syncer --format peft`.
  baseline   one process, no syncer, no island: transformers + peft (`get_peft_model`
             with the rank, alpha and target modules read from yeto's exported adapter),
             torch AdamW at the island's learning rate, 2N steps over all training rows:
             the same number of training tokens as both islands together. It makes its
             batches and its loss as the islands do (`yeto.data.load_blocks` with document
             packing, `BatchSampler`, `yeto.torch.loss.train_step`) and starts from the
             same LoRA init (seed 0), so only federation differs: sharding, N steps of
             progress instead of 2N, averaging by the syncer, the q4 wire.
  base       the base model, no adapter.

One evaluation for all three (`yeto.torch.loss.evaluate`, the islands' own): the
token-weighted mean cross-entropy over the first --eval-blocks blocks of --seq-len tokens
of the packed held-out text (all of them by default), each model loaded fresh (adapters by
`peft.PeftModel.from_pretrained`). `ratio` = yeto's held-out loss / the baseline's (lower
is better; 1 is parity); `gain_share` = (base - yeto) / (base - baseline), the share of the
baseline's improvement the federated run reaches.

Throughput: `island_tok_s` is the mean over the islands of their own `tokens_per_s`
(OUT/yeto/islands/<id>/summary.json, the last line of its metrics.jsonl: input tokens of
every step over the wall time of the training loop, pushes and merges included);
`bare_tok_s` counts the baseline loop's steps the same way (batch x seq-len per step, timed
from its first step). The federated run is given no --eval-data, so no held-out evaluation
runs inside the islands' timed loops. `tok_ratio` = island_tok_s / bare_tok_s. The two
islands and the syncer share the machine while the bare loop runs alone: on a 2-core
machine the islands' tokens/s also pays for that contention.

Goal: none set yet for `ratio` on a real model. For reference: on the tiny models DiLoCo
stays within 1.03 of data-parallel on the same tokens (BENCHMARKS.md); the baseline here
takes twice as many sequential optimizer steps as either island, so it is a stricter
reference than data-parallel, and a short run (3 rounds: the default outer rule is still
near plain averaging) favours it. For `tok_ratio`: >= 0.97 (bench_island.py's goal on an
idle machine).

    .venv/bin/python scripts/bench_real.py            # the default run: ~12 min on 2 cores
    .venv/bin/python scripts/bench_real.py --quick    # a smoke run: ~3 min

Writes into --out: data/, yeto/ (the launch's outputs), yeto-adapter/ (the export),
baseline-adapter/, launch.log. Last line: RESULT ratio=<yeto/baseline> ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# _bench (scripts/) puts the repo root on sys.path before yeto is imported
from _bench import ROOT, result_line

from yeto.config import D
from yeto.display import print_table

PY = sys.executable
QUICK = dict(steps=6, sync_every=2, seq_len=128)  # ~3 minutes: 3 rounds, shorter blocks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a .gguf file or a model dir (default: SmolLM2-135M-Instruct, "
                        "yeto.testing.real.SMOLLM2; fetch it with python -m "
                        "yeto.testing.real --fetch)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-real",
                   help="output folder, replaced on each run (default: runs/bench-real)")
    p.add_argument("--steps", type=int, default=24,
                   help="N, optimizer steps of each island; the baseline runs 2N (default 24)")
    p.add_argument("--sync-every", type=int, default=8,
                   help="H, island steps between pushes: N/H rounds (default 8: 3 rounds)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="blocks per step, islands and baseline alike (default 4)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--lr", type=float, default=D.inner_lr,
                   help=f"AdamW learning rate of the islands and the baseline (default: the "
                        f"island's, {D.inner_lr:g})")
    p.add_argument("--eval-blocks", type=int, default=0,
                   help="held-out blocks evaluated (default 0: all of them)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each island and of the baseline (default 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run, about 3 minutes: --steps {QUICK['steps']} --sync-every "
                        f"{QUICK['sync_every']} --seq-len {QUICK['seq_len']}")
    return p


def resolve_model(model: str | None) -> tuple[str, Path] | None:
    """(the --model the islands get, the float32 model dir the baseline loads), or None
    when the default model is not fetched."""
    from yeto.gguf import is_gguf, model_dir

    if model is None:
        from yeto.testing.real import SMOLLM2

        path = SMOLLM2.available()
        if path is None:
            return None
        model = str(path)
    return model, (model_dir(model) if is_gguf(model) else Path(model))


def federated(args, model: str, train: Path) -> dict:
    """`yeto launch` with two torch islands, then `yeto export` of the syncer's adapter;
    returns the launch's summary with the adapter dir, its wall time and each island's
    tokens/s."""
    out, log = args.out / "yeto", args.out / "launch.log"
    cmd = [PY, "-m", "yeto", "launch", "--islands", "torch,torch", "--model", model,
           "--data", str(train), "--out", str(out), "--overwrite", "--display", "plain",
           "--no-dashboard", "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--lora-r", str(args.lora_r), "--inner-lr", str(args.lr),
           "--max-steps", str(args.steps), "--sync-every", str(args.sync_every),
           "--threads", str(args.threads)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"yeto launch exited {code}; see {log}")
    adapter = args.out / "yeto-adapter"
    subprocess.run([PY, "-m", "yeto", "export", "--state-dir", str(out / "syncer"), "--out",
                    str(adapter), "--format", "peft", "--force"], cwd=ROOT, check=True)
    summary = json.loads((out / "summary.json").read_text())
    rates = {d.name: json.loads((d / "summary.json").read_text())["tokens_per_s"]
             for d in sorted((out / "islands").iterdir())}
    return dict(summary, adapter=adapter, wall_s=seconds, rates=rates)


def baseline(args, base_dir: Path, train: Path, lora: dict) -> dict:
    """The bare loop: transformers + peft + AdamW, 2N steps on one process; returns its
    adapter dir, tokens/s and seconds."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yeto.data import BatchSampler, load_blocks
    from yeto.torch.loss import train_step

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    blocks = load_blocks(train, tok, args.seq_len)  # document packing, as the islands'
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(0)  # the islands' LoRA init (their --seed 0)
    model = get_peft_model(model, LoraConfig(
        r=lora["r"], lora_alpha=lora["lora_alpha"], target_modules=lora["target_modules"],
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=D.weight_decay)
    sampler = BatchSampler(blocks, args.batch_size, seed=0)
    steps, tokens, t0 = 2 * args.steps, 0, time.perf_counter()
    for _ in range(steps):
        mb = next(sampler)
        loss, _ = train_step(model, opt, [mb], "cpu")
        tokens += mb[0].shape[0] * (mb[0].shape[1] - 1)
    seconds = time.perf_counter() - t0
    adapter = args.out / "baseline-adapter"
    model.save_pretrained(str(adapter))
    return dict(adapter=adapter, tok_s=tokens / seconds, seconds=seconds, steps=steps,
                last_loss=loss)


def held_out_loss(base_dir: Path, blocks, batch_size: int, adapter: Path | None) -> float:
    """The one evaluation: the base model loaded fresh, with `adapter` (peft) when given,
    scored by the islands' own `yeto.torch.loss.evaluate` on `blocks`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from yeto.torch.loss import evaluate

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    return evaluate(model, blocks, batch_size, "cpu")


def eval_blocks(args, base_dir: Path, held: Path):
    """The held-out text packed as the islands pack it, its first --eval-blocks blocks."""
    from transformers import AutoTokenizer

    from yeto.data import load_blocks

    blocks = load_blocks(held, AutoTokenizer.from_pretrained(str(base_dir)), args.seq_len,
                         held_out=True)
    return blocks[:args.eval_blocks] if args.eval_blocks else blocks


def report(args, name: str, losses: dict, fed: dict, bare: dict, nblocks: int) -> str:
    """Print the tables; return the RESULT line."""
    rows = [["base (no adapter)", "-", losses["base"]],
            [f"yeto: 2 torch islands x {args.steps} steps, {fed['rounds']} rounds",
             f"{fed['wall_s']:.0f} s", losses["yeto"]],
            [f"baseline: bare peft loop, {bare['steps']} steps", f"{bare['seconds']:.0f} s",
             losses["baseline"]]]
    print(f"\nheld-out loss, {name}, {nblocks} blocks of {args.seq_len} tokens "
          f"(the same evaluation for each):")
    print_table(["model", "time", "held-out loss"], [[a, b, f"{c:.4f}"] for a, b, c in rows],
                right=[1, 2])
    island_tok_s = sum(fed["rates"].values()) / len(fed["rates"])
    print("\ntraining tokens/s (one torch thread each):")
    print_table(["arm", "tokens/s"], [*([f"yeto {k}", f"{v:.0f}"] for k, v in
                                        fed["rates"].items()),
                                      ["bare peft loop", f"{bare['tok_s']:.0f}"]], right=[1])
    gain = losses["base"] - losses["baseline"]
    return result_line(
        losses["yeto"] / losses["baseline"], model=name, base=losses["base"],
        yeto=losses["yeto"], baseline=losses["baseline"],
        gain_share=(losses["base"] - losses["yeto"]) / gain if gain else float("nan"),
        island_tok_s=island_tok_s, bare_tok_s=bare["tok_s"],
        tok_ratio=island_tok_s / bare["tok_s"], rounds=fed["rounds"], steps=args.steps,
        sync_every=args.sync_every, seq_len=args.seq_len, batch=args.batch_size,
        lora_r=args.lora_r, lr=args.lr, eval_blocks=nblocks, bytes_up=fed["bytes_up"],
        bytes_down=fed["bytes_down"], yeto_s=fed["wall_s"], bare_s=bare["seconds"],
        threads=args.threads, cores=os.cpu_count())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.out = args.out.resolve()
    if args.quick:
        vars(args).update(QUICK)
    found = resolve_model(args.model)
    if found is None:
        print("SmolLM2 is not cached: python -m yeto.testing.real --fetch")
        return 2
    model, base_dir = found
    from yeto.testing.real import stdlib_docs

    t0 = time.perf_counter()
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    train, held = stdlib_docs(args.out / "data")
    print(f"federated: 2 torch islands x {args.steps} steps, a push every {args.sync_every}",
          flush=True)
    fed = federated(args, model, train)
    lora = json.loads((fed["adapter"] / "adapter_config.json").read_text())
    print(f"baseline: one process, {2 * args.steps} steps", flush=True)
    bare = baseline(args, base_dir, train, lora)
    blocks = eval_blocks(args, base_dir, held)
    print(f"evaluating base, yeto and baseline on {len(blocks)} held-out blocks", flush=True)
    losses = {k: held_out_loss(base_dir, blocks, args.batch_size, a) for k, a in
              (("base", None), ("yeto", fed["adapter"]), ("baseline", bare["adapter"]))}
    line = report(args, Path(model).name.split(".")[0], losses, fed, bare, len(blocks))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; outputs in {args.out}")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
