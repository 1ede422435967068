"""`yeto demo --rl`: GRPO on the word-reversal task, as local processes.

1. the tiny model and the task (`yeto.testing`);
2. a short SFT warm start (`python -m yeto.learner`, one island, no syncer), so
   that reward is not zero at the start of RL;
3. a syncer, two rollout nodes observing it (one torch, one MLX; `python -m
   yeto.rollout --syncer`), and a GRPO island (`python -m yeto.rl --syncer`; torch, or
   MLX with --trainer mlx) that samples from both and pushes every --sync-every steps;
   every merged Θ reaches both nodes over the wire;
4. held-out reward before and after (greedy, on the island's own weights), and a
   check that no held-out prompt ever went to a node (their request logs).

Writes into --out: model/ data/ sft/ syncer/ nodes/ rl/ and summary.json
(reward_before, reward_after, steps, seconds, sync_every, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto demo --rl", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="GRPO on word reversal: a tiny model, a short SFT warm start, then a "
                    "syncer, a GRPO island and two rollout nodes (torch + MLX) as local "
                    "processes; prints held-out reward before and after.")
    p.add_argument("--out", type=Path, default=Path("runs/demo-rl"), help="output folder")
    p.add_argument("--arch", default="llama", help="tiny model architecture")
    p.add_argument("--sft-steps", type=int, default=80, help="SFT warm-start steps")
    p.add_argument("--max-steps", type=int, default=120, help="GRPO steps")
    p.add_argument("--sync-every", type=int, default=2, help="GRPO steps between pushes")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--inner-lr", type=float, default=1e-3, help="GRPO AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.5,
                   help="sampling temperature (the tiny model's distributions are flat: at "
                        "1.0 samples are close to random words)")
    p.add_argument("--reward", default="reversal_accuracy,exact_match",
                   help="training rewards (comma list, summed); the held-out metric is "
                        "reversal_accuracy")
    p.add_argument("--nodes", default="torch,mlx",
                   help="rollout node backends, observing the syncer; 'direct': torch and "
                        "MLX nodes outside the run, kept current by the trainer "
                        "(yeto rl --update-nodes)")
    p.add_argument("--trainers", type=int, default=1,
                   help="GRPO islands in the run (quorum = this; island i trains on prompt "
                        "rows i mod N); the summary's reward is island 0's")
    p.add_argument("--trainer", choices=("torch", "mlx"), default="torch",
                   help="the GRPO island's backend (yeto rl --backend): torch, or mlx (the "
                        "MLX island as the trainer; no torch in its process)")
    p.add_argument("--outer", default=None,
                   help="the syncer's outer rule (default: the syncer's, auto: plain averaging "
                        "once the GRPO island joins; docs/how-it-works.md, \"The outer rule\")")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="the rule's learning rate (default: the syncer's)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="the rule's momentum (default: the syncer's)")
    p.add_argument("--eval-prompts", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    return p


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_port(port_file: Path, proc: subprocess.Popen, log: Path, timeout: float = 180) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if port_file.is_file() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args[:4])} exited ({proc.returncode}):\n"
                               + log.read_text()[-2000:])
        time.sleep(0.2)
    raise RuntimeError(f"{' '.join(proc.args[:4])} did not listen within {timeout:.0f}s; "
                       f"see {log}")


def warm_start(args, model: Path, train: Path) -> Path:
    out = args.out / "sft"
    cmd = [PY, "-m", "yeto.learner", "--model", str(model), "--data", str(train),
           "--max-steps", str(args.sft_steps), "--output", str(out), "--lora-r", "8",
           "--lora-alpha", "32", "--seq-len", "128", "--batch-size", "8", "--inner-lr", "3e-3",
           "--seed", str(args.seed), "--threads", "1", "--no-progress", "--eval-blocks", "0"]
    proc = _start(cmd, out / "log.txt")
    try:
        proc.wait()
    finally:
        _stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"the SFT warm start failed; see {out / 'log.txt'}")
    return out / "adapter"


def start_nodes(args, model: Path, adapter: Path, syncer: str | None) -> list[dict]:
    """The rollout nodes of --nodes, serving `adapter`, observing `syncer` (None: not in
    a run, they serve `adapter` forever)."""
    nodes = []
    for backend in _backends(args):
        d = args.out / "nodes"
        port_file = d / f"{backend}.port"
        port_file.unlink(missing_ok=True)
        cmd = [PY, "-m", "yeto.rollout", "--model", str(model), "--backend", backend,
               "--adapter", str(adapter), "--port", "0", "--port-file", str(port_file),
               "--node-id", f"rollout-{backend}",
               "--request-log", str(d / f"{backend}.requests.jsonl")]
        if syncer and not _direct(args):
            cmd += ["--syncer", syncer]
        if _direct(args):  # the trainer's adapters, under its output
            (args.out / "rl" / "node-adapters").mkdir(parents=True, exist_ok=True)
            cmd += ["--adapter-root", str(args.out / "rl" / "node-adapters")]
        if backend == "torch":
            cmd += ["--threads", "1"]
        (d / f"{backend}.requests.jsonl").unlink(missing_ok=True)
        nodes.append(dict(backend=backend, log=d / f"{backend}.log", port_file=port_file,
                          proc=_start(cmd, d / f"{backend}.log")))
    for n in nodes:
        n["url"] = f"http://127.0.0.1:{_wait_port(n['port_file'], n['proc'], n['log'])}/v1"
    return nodes


def _direct(args) -> bool:
    return args.nodes.strip() == "direct"


def _backends(args) -> list[str]:
    spec = "torch,mlx" if _direct(args) else args.nodes
    return [b.strip() for b in spec.split(",") if b.strip()]


def run_grpo(args, model: Path, adapter: Path, data: tuple[Path, Path], syncer: str | None,
             nodes: list[dict]) -> dict:
    """The GRPO islands (--trainers) as processes (island 0's progress printed from its
    metrics); returns island 0's summary. Without `syncer` it trains alone and the nodes
    never get its weights."""
    others = [_start(_grpo_cmd(args, model, adapter, data, syncer, nodes, i),
                     args.out / f"rl-{i}.log") for i in range(1, args.trainers)]
    try:
        summary = _run_first(args, _grpo_cmd(args, model, adapter, data, syncer, nodes, 0))
        for i, proc in enumerate(others, 1):
            if proc.wait() != 0:
                raise RuntimeError(f"GRPO island {i} failed ({proc.returncode}); see "
                                   f"{args.out}/rl-{i}.log")
    finally:
        for proc in others:
            _stop(proc, timeout=60)
    return summary


def _grpo_cmd(args, model: Path, adapter: Path, data: tuple[Path, Path], syncer: str | None,
              nodes: list[dict], i: int) -> list[str]:
    """`yeto rl` for GRPO island i (its output in rl/, or rl-<i>/ beyond the first)."""
    out = args.out / ("rl" if i == 0 else f"rl-{i}")
    cmd = [PY, "-m", "yeto.rl", "--model", str(model), "--adapter", str(adapter),
           "--data", str(data[0]), "--eval-data", str(data[1]), "--syncer", syncer or "none",
           "--learner-id", f"grpo-{i}", "--learner-index", str(i),
           "--num-learners", str(args.trainers),
           "--sync-every", str(args.sync_every), "--wire", "f32",
           "--max-steps", str(args.max_steps), "--group-size", str(args.group_size),
           "--prompts-per-step", str(args.prompts_per_step), "--inner-lr", str(args.inner_lr),
           "--temperature", str(args.temperature), "--eval-prompts", str(args.eval_prompts),
           "--warmup-steps", str(args.warmup_steps), "--eval-reward", "reversal_accuracy",
           "--seed", str(args.seed), "--threads", "1", "--output", str(out), "--no-progress",
           "--backend", args.trainer]
    for reward in args.reward.split(","):
        cmd += ["--reward", reward.strip()]
    for n in nodes:
        cmd += ["--rollout-url", n["url"]]
    if _direct(args) and i == 0:  # one trainer keeps the nodes current
        cmd += ["--update-nodes"]
    return cmd


def _run_first(args, cmd: list[str]) -> dict:
    """GRPO island 0, its progress printed as it goes; its summary."""
    out = args.out / "rl"
    (out / "metrics.jsonl").unlink(missing_ok=True)
    proc = _start(cmd, args.out / "rl.log")
    seen = 0
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            seen = _progress(out / "metrics.jsonl", seen, args.max_steps)
    finally:  # Ctrl-C here: the island (in its own session) stops too, saving its work
        _stop(proc, timeout=60)
    _progress(out / "metrics.jsonl", seen, args.max_steps)
    if proc.returncode != 0:
        raise RuntimeError(f"the GRPO island failed ({proc.returncode}); see {args.out}/rl.log")
    return json.loads((out / "summary.json").read_text())


def _outer_rule(tape: Path) -> dict:
    """The outer rule the syncer used, from its tape: the rule's name and the (lr, μ) of
    its last round."""
    merges = [r for r in map(json.loads, tape.read_text().splitlines()) if "responders" in r] \
        if tape.is_file() else []
    last = merges[-1] if merges else {}
    return dict(outer=last.get("outer"), last_step_lr=last.get("step_lr"),
                last_step_momentum=last.get("step_momentum"))


def _progress(metrics: Path, seen: int, total: int) -> int:
    if not metrics.is_file():
        return seen
    lines = metrics.read_text().splitlines()
    for line in lines[seen:]:
        m = json.loads(line)
        if m.get("step") and "reward" in m:
            held = m.get("eval_reward")
            print(f"  step {m['step']:3d}/{total}  train reward {m['reward']:.3f}  held-out "
                  f"{'-' if held is None else f'{held:.3f}'}  version {m['version']}  "
                  f"staleness {m['staleness']}", flush=True)
    return len(lines)


def eval_prompts_at_nodes(nodes: list[dict], held_out: Path, tokenizer_dir: Path) -> int:
    """How many requests to the nodes carried a held-out prompt (must be 0)."""
    from transformers import AutoTokenizer

    from yeto.rl.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    held = {p.ids for p in load_prompts(str(held_out), tok)[0]}
    hits = 0
    for n in nodes:
        log = n["log"].with_name(f"{n['backend']}.requests.jsonl")
        for line in log.read_text().splitlines() if log.is_file() else []:
            hits += sum(tuple(p) in held for p in json.loads(line)["prompts"])
    return hits


def node_status(nodes: list[dict]) -> list[dict]:
    import urllib.request

    out = []
    for n in nodes:
        try:
            with urllib.request.urlopen(n["url"][:-3] + "/yeto/status", timeout=10) as r:
                s = json.loads(r.read())
        except OSError as e:
            s = dict(error=str(e))
        out.append({**s, "backend": n["backend"], "url": n["url"]})
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.out = args.out.resolve()
    if args.trainers < 1:
        build_parser().error(f"--trainers must be at least 1, got {args.trainers}")
    t0 = time.monotonic()
    from syncer.flags import outer_args
    from syncer.spawn import start_syncer
    from yeto.io import atomic_write
    from yeto.testing.tasks import make_task
    from yeto.testing.tiny import make_tiny_model

    print(f"building the tiny {args.arch} model and the task in {args.out} ...", flush=True)
    model = make_tiny_model(args.out / "model", arch=args.arch)
    train, held_out = make_task(args.out / "data")
    print(f"SFT warm start: {args.sft_steps} steps ...", flush=True)
    adapter = warm_start(args, model, train)
    (args.out / "syncer").mkdir(parents=True, exist_ok=True)
    nodes: list[dict] = []
    try:
        with start_syncer(["--quorum", str(args.trainers),
                           "--state-dir", str(args.out / "syncer" / "state"),
                           *outer_args(args.outer, args.outer_lr, args.outer_momentum)],
                          log=args.out / "syncer" / "log.txt") as syncer:
            nodes = start_nodes(args, model, adapter, syncer.address)
            print(f"syncer {syncer.address}; rollout nodes: "
                  + ", ".join(f"{n['backend']} {n['url']}" for n in nodes), flush=True)
            print(f"GRPO: {args.max_steps} steps, G={args.group_size} x {args.prompts_per_step} "
                  f"prompts, weights to the nodes every {args.sync_every} steps", flush=True)
            rl = run_grpo(args, model, adapter, (train, held_out), syncer.address, nodes)
            status = node_status(nodes)
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return 1
    finally:
        for n in nodes:
            _stop(n["proc"])
    summary = dict(reward_before=rl["reward_before"], reward_after=rl["reward_after"],
                   trainer=args.trainer, trainers=args.trainers, steps=rl["steps"],
                   seconds=round(time.monotonic() - t0, 1),
                   sync_every=args.sync_every, sync_cadence=f"every {args.sync_every} steps",
                   outer_rule=_outer_rule(args.out / "syncer" / "state" / "tape.jsonl"),
                   sft_steps=args.sft_steps, group_size=args.group_size,
                   prompts_per_step=args.prompts_per_step, eval_prompts=rl["eval_prompts"],
                   eval_via=rl["eval_via"],
                   held_out_prompts_sent_to_nodes=eval_prompts_at_nodes(nodes, held_out, model),
                   staleness_mean=rl["staleness_mean"], logprob_gap_mean=rl["logprob_gap_mean"],
                   version=rl["version"], nodes=status, grpo_seconds=rl["seconds"],
                   node_weights="from the trainer (--update-nodes)" if _direct(args) else
                   "observing the syncer", node_lag=[n.get("lag") for n in rl["nodes"]])
    atomic_write(args.out / "summary.json", json.dumps(summary, indent=2))
    print(f"\nheld-out reward (greedy, word-level reversal accuracy): "
          f"{summary['reward_before']:.3f} -> {summary['reward_after']:.3f}  "
          f"({summary['steps']} GRPO steps on the {args.trainer} trainer, weights to the nodes "
          f"every {args.sync_every} steps, {summary['seconds']:.0f} s)")
    print(f"summary: {args.out / 'summary.json'}")
    return 0
