"""Rollout nodes for RL: sampling throughput against each backend's bare generate, and
how the sync cadence (weights reaching the nodes every H steps) shapes GRPO.

Goal: a rollout node (`python -m yeto.rollout`) samples a GRPO batch (P prompts x G
completions, with token ids and logprobs) at least as fast as its backend's own
generate on the same weights (transformers `generate`, batched; `mlx_lm.generate`,
one sequence at a time), and GRPO with weights reaching the nodes every 1-2 steps
learns more per step than every 5 steps or never (the seed's table, measured here
on the tiny model and the word-reversal task).

Part 1, throughput (in process, same weights, measured interleaved): completion
tokens per second of a node over HTTP (requests sent at once, batched by the node,
EOS ignored so every row has M tokens) against the bare generate of the same workload.

Part 2, cadence (in this process: scripts/_rl_cadence.py): GRPO from an SFT warm
start, the trainer sampling through yeto's real pool and an in-process torch rollout
node (HTTP on loopback) whose weights are refreshed from the trainer every H steps
("never": it keeps the warm start), each cadence with sampling synchronous and
asynchronous (--async-rollouts, --max-staleness). Per arm, over seeds: held-out
reward (greedy, the trainer's own weights) before and after, wall time of the GRPO
steps, staleness in versions and in trainer steps, the behaviour-recomputed logprob
gap, stale batches dropped. Each (arm, seed) result is cached under OUT/cadence/, so
an interrupted run resumes (--fresh redoes them).

The last line is `RESULT ratio=<torch node tok/s / transformers generate tok/s> ...`
with the MLX ratio and the reward change of each cadence arm.

    python scripts/bench_rollout.py                     # both parts
    python scripts/bench_rollout.py --parts cadence     # the cadence table only
    python scripts/bench_rollout.py --quick             # small workloads, two short arms
"""

from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from _bench import ROOT, interleaved, parser, result_line

from yeto.display import markdown_table, print_table

SFT_STEPS = 90  # the warm start: held-out reward well above 0 and well below 1 (BENCHMARKS.md)


def _args():
    p = parser(__doc__.split("\n\n")[0], __doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-rollout")
    p.add_argument("--prompts", type=int, default=8, help="P: prompts per batch")
    p.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="M: tokens per completion")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--parts", default="throughput,cadence")
    g = p.add_argument_group("part 2, cadence (each arm's result cached under OUT/cadence)")
    g.add_argument("--cadences", default="1,2,5,10,never",
                   help="steps between the node's weight refreshes; 'never': the warm start")
    g.add_argument("--modes", default="sync,async",
                   help="sync: each step's batch drawn when it starts; async: drawn while the "
                        "previous step trains (--async-rollouts)")
    g.add_argument("--max-staleness", type=int, default=1, help="the async arms' bound")
    g.add_argument("--steps", type=int, default=300, help="GRPO steps per run")
    g.add_argument("--prompts-per-step", type=int, default=8, help="GRPO prompts per step")
    g.add_argument("--cadence-max-tokens", type=int, default=16, help="tokens per completion")
    g.add_argument("--sft-steps", type=int, default=SFT_STEPS, help="SFT warm-start steps")
    g.add_argument("--inner-lr", type=float, default=1e-3)
    g.add_argument("--warmup-steps", type=int, default=10)
    g.add_argument("--temperature", type=float, default=0.5)
    g.add_argument("--reward", default="reversal_accuracy", help="training rewards, comma list")
    g.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts (greedy)")
    g.add_argument("--seeds", default="0,1,2",
                   help="seeds (warm start, prompt order, sampling): every arm runs once per "
                        "seed; the table shows the mean and the spread")
    g.add_argument("--fresh", action="store_true", help="ignore cached arm results")
    g.add_argument("--cached-only", action="store_true",
                   help="the table from cached arm results only (runs nothing; the seeds "
                        "column says how many each row has)")
    return p.parse_args()


# ---- part 1: throughput -----------------------------------------------------------------
def _workload(model_dir: Path, data: Path, n: int):
    from transformers import AutoTokenizer

    from yeto.rl.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok, [list(p.ids) for p in load_prompts(str(data), tok)[0][:n]]


def node_rate(engine, prompts, g: int, m: int):
    """A function that samples the workload through a node over HTTP (one request per
    prompt, sent at once) and returns the completion tokens it got."""
    from yeto.rl.pool import post_json
    from yeto.rollout.engine import stop_token_ids
    from yeto.rollout.server import RolloutNode, serve_in_thread

    node = RolloutNode(engine, model_name="bench",
                       eos_ids=stop_token_ids(engine.model_dir, engine.tokenizer))
    server, url = serve_in_thread(node)
    counts: list[int] = []

    def one(p):
        body = dict(prompt=p, n=g, max_tokens=m, temperature=1.0, ignore_eos=True, logprobs=0,
                    return_tokens_as_token_ids=True)
        reply = post_json(f"{url}/v1/completions", body, 600)
        counts.append(reply["usage"]["completion_tokens"])

    def run():
        counts.clear()
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts)

    return run, lambda: (server.shutdown(), server.server_close(), node.close())


def torch_generate(engine, tok, prompts, g: int, m: int):
    """transformers `generate` on the same model: the workload as one left-padded batch."""
    import torch

    rows = [p for p in prompts for _ in range(g)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])

    def run():
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                        max_new_tokens=m, min_new_tokens=m,
                                        pad_token_id=tok.pad_token_id)
        return int((out.shape[1] - width) * out.shape[0])

    return run


def mlx_generate(engine, prompts, g: int, m: int):
    """`mlx_lm.generate` on the same model, one completion at a time (EOS ignored)."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tok = TokenizerWrapper(engine.tokenizer)
    tok._eos_token_ids = set()  # the same fixed-length workload as the node's
    sampler = make_sampler(temp=1.0)

    def run():
        total = 0
        for p in prompts:
            for _ in range(g):
                text = generate(engine.model, tok, p, max_tokens=m, sampler=sampler)
                total += len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        return total

    return run


def throughput(args, model_dir: Path, adapter: Path, data: Path) -> dict:
    from yeto.rollout.adapters import read_adapter
    from yeto.rollout.torch_engine import TorchEngine

    tok, prompts = _workload(model_dir, data, args.prompts)
    spec = read_adapter(adapter, model_dir)[1]
    backends = {"torch": lambda: TorchEngine(model_dir, spec)}
    try:
        from yeto.rollout.mlx_engine import MLXEngine

        backends["mlx"] = lambda: MLXEngine(model_dir, spec)
    except ImportError:
        print("mlx-lm not installed: the MLX node is not measured", file=sys.stderr)
    out = {}
    for name, make in backends.items():
        engine = make()
        engine.load_adapter(adapter)
        node_run, stop = node_rate(engine, prompts, args.group_size, args.max_tokens)
        bare = (torch_generate(engine, tok, prompts, args.group_size, args.max_tokens)
                if name == "torch" else mlx_generate(engine, prompts, args.group_size,
                                                      args.max_tokens))
        tokens = {"node": node_run(), "bare": bare()}  # warm up, and count
        best = interleaved({"node": node_run, "bare": bare}, args.repeat)
        stop()
        out[name] = {k: tokens[k] / best[k] for k in best}
    return out


# ---- part 2: cadence (scripts/_rl_cadence.py) ---------------------------------------------
def cadence_table(args, model: Path, adapter, data, seeds: list[int]) -> dict:
    import _rl_cadence

    if args.quick:  # a smoke run of the path: two arms, a few steps, one seed
        args.cadences, args.steps, args.eval_prompts = "1,never", 6, 16
        args.group_size, args.prompts_per_step = 4, 4
    rows, headers, kv = _rl_cadence.table(args, model, adapter, data, seeds)
    print(f"\ncadence: GRPO on word reversal in this process, {args.steps} steps, "
          f"G={args.group_size} x {args.prompts_per_step} prompts, T={args.temperature}, "
          f"lr {args.inner_lr}, SFT warm start {args.sft_steps} steps, one torch node, "
          f"seeds {args.seeds} (mean ± standard deviation over seeds)")
    print_table(headers, rows)
    print(markdown_table(headers, rows))
    return kv


def main() -> int:
    args = _args()
    from yeto.testing.tasks import make_task
    from yeto.testing.tiny import make_tiny_model

    args.out = args.out.resolve()
    if args.quick:
        args.sft_steps, args.seeds = 20, args.seeds.split(",")[0]
    model = make_tiny_model(args.out / "model")
    data = make_task(args.out / "data")
    seeds = [int(x) for x in args.seeds.split(",")]
    adapter = functools.cache(lambda seed: warm(args, model, data[0], seed))  # when needed
    kv: dict = {}
    ratio = float("nan")
    if "throughput" in args.parts:
        if args.quick:
            args.prompts, args.group_size, args.max_tokens, args.repeat = 4, 4, 16, 1
        rates = throughput(args, model, adapter(seeds[0]), data[1])
        rows = [[name, f"{r['node']:.0f}", f"{r['bare']:.0f}", f"{r['node'] / r['bare']:.2f}x"]
                for name, r in rates.items()]
        headers = ["node", "node tok/s", "bare generate tok/s", "ratio"]
        print(f"\nthroughput: P={args.prompts} x G={args.group_size} x M={args.max_tokens}")
        print_table(headers, rows)
        print(markdown_table(headers, rows))
        t, m = rates["torch"], rates.get("mlx")
        ratio = t["node"] / t["bare"]
        kv.update(torch_node_tok_s=t["node"], torch_generate_tok_s=t["bare"],
                  mlx_ratio=m["node"] / m["bare"] if m else "n/a")
    if "cadence" in args.parts:
        kv.update(cadence_table(args, model, adapter, data, seeds))
    print(result_line(ratio, **kv))
    return 0


def warm(args, model: Path, train: Path, seed: int) -> Path:
    from yeto.rl import demo

    ns = SimpleNamespace(out=args.out / f"seed{seed}", seed=seed, sft_steps=args.sft_steps)
    return demo.warm_start(ns, model, train)


if __name__ == "__main__":
    sys.exit(main())
