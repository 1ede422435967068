"""GRPO on a real instruct model: SmolLM2-135M-Instruct (a GGUF file) on
one-digit arithmetic, with a rollout node, as local processes.

The task (`yeto.testing.tasks.make_arithmetic_task`): chat rows "What is a + b? Answer
with just the number." (a, b in 1..9) and "What is a * b? ..." (a, b in 2..9); the
reward is `number_match` (the last number of the completion equals the answer).
Held-out problems are whole unordered operand pairs kept out of training (neither a op b
nor b op a is trained on); the split is fixed by --data-seed, the same for every --seed.

The topology is `yeto demo --rl --nodes direct` with one torch node: a syncer
(quorum 1, its default outer rule), one torch rollout node outside the run, and one torch
GRPO island that samples from it and keeps it current (`yeto rl --update-nodes`).
Reuses `yeto.rl.demo`'s process helpers.

    .venv/bin/python scripts/rl_real.py --seed 0 --out runs/rl-real/s0
    .venv/bin/python scripts/rl_real.py --base-only       # the base model's held-out reward

Writes into --out: data/ syncer/ nodes/ rl/ rl.log and summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from yeto.rl import demo  # noqa: E402
from yeto.testing.tasks import make_arithmetic_task  # noqa: E402

PY = sys.executable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="a .gguf file or a model dir (default: SmolLM2-135M-Instruct, "
                        "yeto.testing.real.SMOLLM2)")
    p.add_argument("--out", type=Path, default=Path("runs/rl-real"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=1234, help="the train/held-out split")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--sync-every", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--inner-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--reward", default="number_match")
    p.add_argument("--eval-prompts", type=int, default=0, help="0: all held-out rows")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads of the node and of the trainer (they take turns)")
    p.add_argument("--outer", default=None, help="the syncer's outer rule (default: its own)")
    p.add_argument("--base-only", action="store_true",
                   help="only score the base model greedily on the held-out rows")
    return p


def start_node(args, model: str) -> dict:
    """One torch rollout node outside the run, serving a fresh LoRA of the trainer's
    shape; the trainer loads its adapters into it (--update-nodes)."""
    d = args.out / "nodes"
    d.mkdir(parents=True, exist_ok=True)
    adapters = args.out / "rl" / "node-adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    port_file, log, reqs = d / "torch.port", d / "torch.log", d / "torch.requests.jsonl"
    port_file.unlink(missing_ok=True)
    reqs.unlink(missing_ok=True)
    cmd = [PY, "-m", "yeto.rollout", "--model", model, "--backend", "torch", "--port", "0",
           "--port-file", str(port_file), "--node-id", "rollout-torch", "--request-log",
           str(reqs), "--adapter-root", str(adapters), "--lora-r", str(args.lora_r),
           "--lora-alpha", str(args.lora_alpha), "--seed", str(args.seed),
           "--threads", str(args.threads)]
    node = dict(backend="torch", log=log, port_file=port_file, proc=demo._start(cmd, log))
    node["url"] = f"http://127.0.0.1:{demo._wait_port(port_file, node['proc'], log)}/v1"
    return node


def grpo_cmd(args, model: str, data: tuple[Path, Path], syncer: str, node: dict,
             max_steps: int) -> list[str]:
    cmd = [PY, "-m", "yeto.rl", "--model", model, "--data", str(data[0]),
           "--eval-data", str(data[1]), "--syncer", syncer, "--learner-id", "grpo-0",
           "--sync-every", str(args.sync_every), "--wire", "f32",
           "--max-steps", str(max_steps), "--group-size", str(args.group_size),
           "--prompts-per-step", str(args.prompts_per_step),
           "--max-new-tokens", str(args.max_new_tokens), "--inner-lr", str(args.inner_lr),
           "--lora-r", str(args.lora_r), "--lora-alpha", str(args.lora_alpha),
           "--temperature", str(args.temperature), "--eval-prompts", str(args.eval_prompts),
           "--warmup-steps", str(args.warmup_steps), "--eval-reward", "number_match",
           "--seed", str(args.seed), "--threads", str(args.threads),
           "--output", str(args.out / "rl"), "--no-progress", "--backend", "torch",
           "--rollout-url", node["url"], "--update-nodes"]
    for reward in args.reward.split(","):
        cmd += ["--reward", reward.strip()]
    return cmd


def base_only(args, model: str, data: tuple[Path, Path]) -> dict:
    """The base model's greedy held-out reward, in process (what the island's first
    evaluation computes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yeto.rl.prompts import load_prompts
    from yeto.rl.rewards import number_match

    torch.set_num_threads(max(1, args.threads))
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompts, _ = load_prompts(str(data[1]), tok)
    scores, samples = [], []
    for p in prompts:
        ids = torch.tensor([p.ids])
        with torch.no_grad():
            g = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=args.max_new_tokens)
        text = tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True)
        scores.append(number_match(text, reference=p.reference))
        samples.append(dict(reference=p.reference, completion=text))
    return dict(reward=sum(scores) / len(scores), prompts=len(scores), samples=samples[:8])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.out = args.out.resolve()
    t0 = time.monotonic()
    from syncer.flags import outer_args
    from syncer.spawn import start_syncer
    from yeto.gguf import is_gguf, model_dir
    from yeto.io import atomic_write

    if args.model is None:
        from yeto.testing.real import SMOLLM2
        path = SMOLLM2.available()
        if path is None:
            print("SmolLM2 is not cached: python -m yeto.testing.real --fetch")
            return 2
        args.model = str(path)
    model = str(model_dir(args.model)) if is_gguf(args.model) else args.model
    data = make_arithmetic_task(args.out / "data", seed=args.data_seed)
    if args.base_only:
        res = base_only(args, model, data)
        print(json.dumps(res, indent=2))
        return 0
    (args.out / "syncer").mkdir(parents=True, exist_ok=True)
    node = None
    try:
        with start_syncer(["--quorum", "1", "--state-dir", str(args.out / "syncer" / "state"),
                           *outer_args(args.outer, None, None)],
                          log=args.out / "syncer" / "log.txt") as syncer:
            node = start_node(args, model)
            print(f"syncer {syncer.address}; rollout node {node['url']}", flush=True)
            print(f"GRPO: {args.max_steps} steps, G={args.group_size} x "
                  f"{args.prompts_per_step} prompts, lr {args.inner_lr}, LoRA r "
                  f"{args.lora_r}", flush=True)
            rl = demo._run_first(args, grpo_cmd(args, model, data, syncer.address, node,
                                                args.max_steps))
            status = demo.node_status([node])
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return 1
    finally:
        if node is not None:
            demo._stop(node["proc"])
    summary = dict(model=args.model, task="one-digit + and * (number_match)",
                   seed=args.seed, reward_before=rl["reward_before"],
                   reward_after=rl["reward_after"], steps=rl["steps"],
                   seconds=round(time.monotonic() - t0, 1), grpo_seconds=rl["seconds"],
                   sync_every=args.sync_every, group_size=args.group_size,
                   prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
                   inner_lr=args.inner_lr, lora_r=args.lora_r, temperature=args.temperature,
                   eval_prompts=rl["eval_prompts"], eval_via=rl["eval_via"],
                   outer_rule=demo._outer_rule(args.out / "syncer" / "state" / "tape.jsonl"),
                   held_out_prompts_sent_to_nodes=demo.eval_prompts_at_nodes(
                       [node], data[1], Path(model)),
                   staleness_mean=rl["staleness_mean"], logprob_gap_mean=rl["logprob_gap_mean"],
                   version=rl["version"], nodes=status,
                   node_lag=[n.get("lag") for n in rl["nodes"]])
    atomic_write(args.out / "summary.json", json.dumps(summary, indent=2))
    print(f"\nheld-out reward (greedy, number_match, {summary['eval_prompts']} prompts): "
          f"{summary['reward_before']:.3f} -> {summary['reward_after']:.3f}  "
          f"({summary['steps']} GRPO steps, {summary['seconds']:.0f} s)")
    print(f"summary: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
