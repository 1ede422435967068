"""DiLoCo as the paper writes it (Algorithm 1), in plain torch, in one process: the
independent reference that yeto's outer loop is checked against
(tests/e2e/test_reference_diloco.py).

DiLoCo (Douillard et al., 2023, arXiv:2311.08105), Algorithm 1, for k replicas:

    Θ⁰: the initial weights
    for outer step t = 1 .. T:
        for replica i = 1 .. k:
            θᵢ ← Θᵗ⁻¹
            for inner step h = 1 .. H:
                θᵢ ← InnerOpt(θᵢ, ∇L(xᵢ))     AdamW; each replica keeps its state
            δᵢ ← Θᵗ⁻¹ − θᵢ                    the outer gradient (pseudo-gradient)
        Δ ← (1/k) Σᵢ δᵢ
        Θᵗ ← OuterOpt(Θᵗ⁻¹, Δ)               torch.optim.SGD(nesterov=True), lr 0.7,
                                             momentum 0.9; lr 1, momentum 0: plain
                                             averaging (Θᵗ = the mean of the θᵢ)

Shared with yeto: only the data (`yeto.data.load_blocks`, `BatchSampler`): replica i
trains on the batches yeto's island i draws (shard i of k, sampler seed + i). The model
(transformers), LoRA (peft, seeded as the islands seed it), the loss, AdamW and the
outer SGD are written here.

Where yeto means to differ, an option makes the reference do the same:
  --token-weights  Δ = Σᵢ wᵢδᵢ / Σᵢ wᵢ, wᵢ = replica i's loss tokens in the round
                   (yeto's default merge, `--merge mean`; Algorithm 1 is `--merge uniform`)
  --q4             each δᵢ crosses yeto's q4 wire, with error feedback (`yeto.codec`)
  --overlap D      the island that trains on while its round commits: a replica makes D
                   more steps before Θᵗ arrives and keeps them,
                   θᵢ ← Θᵗ + (θᵢ now − θᵢ at its push)
and one changes no mathematics, only float32 rounding:
  --yeto-rounding  the Nesterov step with its operations in the order of yeto's syncer
                   (`syncer.strategy.Nesterov`: m ← μm + Δ, Θ ← Θ − lr·Δ − (lr·μ)·m)
                   instead of torch's SGD (Θ ← Θ − lr·(Δ + μm)): the two round
                   differently in the last bit, and training amplifies that round by
                   round, so long runs match yeto bit for bit only with it

With --yeto each case also runs through `yeto.sim` (k islands and the syncer, in this
process) with the same settings (`--blocking-sync` unless --overlap, f32 both ways
unless --q4, `--merge uniform` unless --token-weights) and is compared: per round each
island's training loss at its push and Θ after the round, and the final weights.
--case runs several cases in one process, each into its own folder under --out.
Last line: `RESULT max_loss_rel=… max_theta_rel=… cases=…`.

Example:
    python -m yeto.testing.reference_diloco --model runs/demo/model \\
        --data runs/demo/data/train.jsonl --islands 2 --rounds 3 --sync-every 5 \\
        --outer-lr 0.7 --outer-momentum 0.9 --yeto --out runs/reference
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Case:
    """One DiLoCo run: the flags' names and defaults."""

    model: str = ""
    data: str = ""
    eval_data: str | None = None
    eval_blocks: int = 16
    tuning: str = "lora"
    islands: int = 2
    rounds: int = 3
    sync_every: int = 5
    seq_len: int = 32
    batch_size: int = 4
    lora_r: int = 4
    lora_alpha: float = 8.0
    inner_lr: float = 1e-3
    weight_decay: float = 0.0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    token_weights: bool = False
    q4: bool = False
    overlap: int = 0
    yeto_rounding: bool = False
    seed: int = 3
    threads: int = 1


@dataclass
class Trace:
    """What a run did: per island the training loss by step (yeto: at its pushes) and
    the loss tokens of each round; Θ after each round ("0": the start, "final": the
    weights the run ends on), by canonical name; the final held-out loss."""

    losses: dict[str, dict[int, float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    thetas: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    eval_loss: float | None = None

    def save(self, folder: Path, side: str) -> None:
        from safetensors.numpy import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({f"{when}/{name}": np.ascontiguousarray(v)
                   for when, theta in self.thetas.items() for name, v in theta.items()},
                  str(folder / f"{side}.safetensors"))
        (folder / f"{side}.json").write_text(json.dumps(dict(
            losses=self.losses, tokens=self.tokens, eval_loss=self.eval_loss), indent=1))

    @classmethod
    def load(cls, folder: Path, side: str) -> Trace:
        from safetensors.numpy import load_file

        meta = json.loads((folder / f"{side}.json").read_text())
        thetas: dict[str, dict[str, np.ndarray]] = {}
        for key, v in load_file(str(folder / f"{side}.safetensors")).items():
            when, name = key.split("/", 1)
            thetas.setdefault(when, {})[name] = v
        losses = {i: {int(s): x for s, x in by_step.items()}
                  for i, by_step in meta["losses"].items()}
        return cls(losses, meta["tokens"], thetas, meta["eval_loss"])


# ---- the reference ------------------------------------------------------------------
def lora_name(param_name: str) -> str:
    """peft's saved key (the adapter's name dropped): the name yeto's layout uses."""
    return param_name.replace(".default.", ".")


def batch_loss(model, batch):
    """Σ w·CE / Σ w over one batch of packed blocks (the targets are the tokens shifted
    by one; w: each target's loss weight). Documents packed into one block do not see
    each other: positions restart at each document, with a block-diagonal mask."""
    import torch
    import torch.nn.functional as F

    from yeto.data import attention_mask, is_naive

    tokens = torch.from_numpy(batch.tokens)
    kw = {}
    if not is_naive(batch.positions):
        kw = dict(position_ids=torch.from_numpy(batch.positions).long(), use_cache=False,
                  attention_mask=torch.from_numpy(attention_mask(batch.positions))[:, None])
    logits = model(input_ids=tokens[:, :-1], **kw).logits
    ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten().long(),
                         reduction="none")
    w = torch.from_numpy(batch.weights).flatten()
    return (ce * w).sum() / w.sum()


class Replica:
    """One DiLoCo replica: its copy of the model, its AdamW (state kept across rounds,
    as in the paper) and its batches."""

    def __init__(self, case: Case, index: int, tokenizer):
        import torch
        from transformers import AutoModelForCausalLM

        from yeto.data import BatchSampler, load_blocks

        model = AutoModelForCausalLM.from_pretrained(case.model, dtype=torch.float32)
        if case.tuning == "lora":
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(case.seed)  # every replica starts from the same adapter
            model = get_peft_model(model, LoraConfig(
                r=case.lora_r, lora_alpha=case.lora_alpha, target_modules="all-linear",
                lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        self.model = model.train()
        self.params = {lora_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=case.inner_lr,
                                     weight_decay=case.weight_decay)
        blocks = load_blocks(case.data, tokenizer, case.seq_len, shard=(index, case.islands))
        self.batches = BatchSampler(blocks, case.batch_size, seed=case.seed + index)
        self.steps, self.losses = 0, {}

    def train(self, until: int) -> int:
        """Inner AdamW steps up to step `until`; returns their loss tokens."""
        tokens = 0
        while self.steps < until:
            batch = next(self.batches)
            self.opt.zero_grad(set_to_none=True)
            loss = batch_loss(self.model, batch)
            loss.backward()
            self.opt.step()
            self.steps += 1
            self.losses[self.steps] = float(loss.detach())
            tokens += int(np.count_nonzero(batch.weights))
        return tokens

    def weights(self) -> dict:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def adopt(self, theta: dict, at_push: dict | None) -> None:
        """θ ← Θ, plus the steps made since the push (`at_push`: θ then) when it
        trained on while the round committed."""
        import torch

        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(theta[n] if at_push is None else theta[n] + (p - at_push[n]))


class Wire:
    """yeto's q4 uplink, applied to each replica's δ: flattened in yeto's canonical
    order, plus the replica's residual, quantized, the new residual kept."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], k: int):
        from yeto.codec import ErrorFeedback
        from yeto.layout import Layout

        self.layout = Layout.from_shapes(shapes)
        self.feedback = [ErrorFeedback(self.layout.numel, "q4") for _ in range(k)]

    def send(self, i: int, delta: dict) -> dict:
        import torch

        from yeto import codec

        flat = self.layout.flatten({n: d.numpy() for n, d in delta.items()})
        got = codec.decode(self.feedback[i].encode(flat), "q4", self.layout.numel)
        return {n: torch.from_numpy(v.copy()) for n, v in self.layout.unflatten(got).items()}


def run_reference(case: Case, settle=None) -> Trace:
    """Algorithm 1 (with the options of `Case`); see the module's docstring.
    `settle(t, i, replicas)`, if given, is called after replica i's inner steps of
    round t, before its δ is taken (scripts/compare_torchft.py models torchft with it)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(case.threads)
    tok = AutoTokenizer.from_pretrained(case.model)
    replicas = [Replica(case, i, tok) for i in range(case.islands)]
    theta = {n: torch.nn.Parameter(p) for n, p in replicas[0].weights().items()}
    outer = (SyncerRounding if case.yeto_rounding else torch.optim.SGD)(
        list(theta.values()), lr=case.outer_lr, momentum=case.outer_momentum,
        nesterov=case.outer_momentum > 0)
    wire = Wire({n: tuple(p.shape) for n, p in theta.items()}, case.islands) if case.q4 \
        else None
    trace = Trace(thetas={"0": _snapshot(theta)})
    names = [f"island-{i}" for i in range(case.islands)]
    ahead = [0] * case.islands  # --overlap: loss tokens of the steps made since a push
    for t in range(1, case.rounds + 1):
        deltas, weights, at_push = [], [], []
        for i, r in enumerate(replicas):
            tokens = ahead[i] + r.train(t * case.sync_every)
            trace.tokens.setdefault(names[i], []).append(tokens)
            if settle is not None:
                settle(t, i, replicas)
            delta = {n: theta[n].detach() - p.detach() for n, p in r.params.items()}
            deltas.append(wire.send(i, delta) if wire else delta)
            weights.append(float(tokens) if case.token_weights else 1.0)
            at_push.append(r.weights() if case.overlap else None)
            if case.overlap and t < case.rounds:
                ahead[i] = r.train(t * case.sync_every + case.overlap)
        outer_step(outer, theta, deltas, weights)
        for r, mine in zip(replicas, at_push):
            r.adopt({n: p.detach() for n, p in theta.items()}, mine)
        trace.thetas[str(t)] = _snapshot(theta)
    trace.thetas["final"] = trace.thetas[str(case.rounds)]
    trace.losses = {names[i]: dict(r.losses) for i, r in enumerate(replicas)}
    if case.eval_data:
        trace.eval_loss = evaluate(case, replicas[0], tok)
    return trace


def outer_step(outer, theta: dict, deltas: list[dict], weights: list[float]) -> None:
    """Δ = Σᵢ wᵢδᵢ / Σᵢ wᵢ (wᵢ = 1: Algorithm 1's mean), then one step of the outer
    optimizer with Δ as Θ's gradient."""
    total = sum(weights)
    for n, p in theta.items():
        g = deltas[0][n] * weights[0]
        for d, w in zip(deltas[1:], weights[1:]):
            g = g + d[n] * w
        p.grad = g / total
    outer.step()
    outer.zero_grad(set_to_none=True)


class SyncerRounding:
    """torch's SGD with nesterov=True, its float32 operations in the order of yeto's
    syncer (`syncer.strategy.Nesterov.step`): m ← μm + g; Θ ← Θ − lr·g; Θ ← Θ − (lr·μ)·m
    (torch: Θ ← Θ − lr·(g + μm)). With momentum 0: Θ ← Θ − lr·g, as torch."""

    def __init__(self, params: list, lr: float, momentum: float, nesterov: bool):
        import torch

        self.params, self.lr, self.momentum = params, np.float32(lr), np.float32(momentum)
        self.lr_momentum = np.float32(lr * momentum)  # one product, as the syncer takes it
        self.m = [torch.zeros_like(p) for p in params] if momentum and nesterov else None

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for i, p in enumerate(self.params):
                g = p.grad
                if self.m is not None:
                    self.m[i].mul_(self.momentum).add_(g)
                p.sub_(g * self.lr)
                if self.m is not None:
                    p.sub_(self.m[i] * self.lr_momentum)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def evaluate(case: Case, replica: Replica, tokenizer) -> float:
    """The held-out loss of the replica's weights (after the last round: Θ): Σ w·CE /
    Σ w over the first --eval-blocks held-out blocks."""
    import torch

    from yeto.data import load_blocks

    blocks = load_blocks(case.eval_data, tokenizer, case.seq_len, held_out=True)
    blocks = blocks[:case.eval_blocks] if case.eval_blocks else blocks
    replica.model.eval()
    total = weight = 0.0
    with torch.no_grad():
        for lo in range(0, len(blocks), case.batch_size):
            b = blocks[lo:lo + case.batch_size]
            w = float(b.weights.sum())
            total += float(batch_loss(replica.model, b)) * w
            weight += w
    replica.model.train()
    return total / weight


def _snapshot(theta: dict) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in theta.items()}


# ---- yeto, through yeto.sim ------------------------------------------------------------
def run_yeto(case: Case, out: Path) -> Trace:
    """The same case through `yeto.sim`'s fleet (k islands and the syncer's Run in this
    process); Θ is read off each broadcast as the syncer publishes it."""
    from syncer.run import Config, Run
    from yeto.config import IslandConfig
    from yeto.sim import fleet

    published: dict[str, np.ndarray] = {}
    runs: list[Run] = []

    class Recorder(Run):  # the syncer's run, unchanged; it notes each Θ it publishes
        def announce(self, broadcast) -> None:
            super().announce(broadcast)
            published["final" if broadcast.final else str(broadcast.version)] = \
                self.theta.copy()
            runs[:] = [self]

    base = IslandConfig(
        model=case.model, data=case.data, eval_data=case.eval_data,
        eval_blocks=case.eval_blocks, tuning=case.tuning, seq_len=case.seq_len,
        batch_size=case.batch_size, lora_r=case.lora_r, lora_alpha=case.lora_alpha,
        inner_lr=case.inner_lr, weight_decay=case.weight_decay, sync_every=case.sync_every,
        max_steps=case.rounds * case.sync_every, wire="q4" if case.q4 else "f32",
        blocking_sync=not case.overlap, seed=case.seed, threads=case.threads,
        num_learners=case.islands, progress=False, log_level="WARNING").check()
    syncer = Config(quorum=case.islands, grace_ms=0, grace="fixed", outer="nesterov",
                    outer_lr=case.outer_lr, outer_momentum=case.outer_momentum, downlink="f32",
                    merge="mean" if case.token_weights else "uniform")
    original, fleet.Run = fleet.Run, Recorder
    try:  # simulated time for --overlap: when Θ arrives does not depend on the machine
        result = fleet.run_fleet(base, syncer, case.islands, out,
                                 step_seconds=1.0 if case.overlap else 0.0)
    finally:
        fleet.Run = original
    return _yeto_trace(out, runs[0].layout, published, result)


def _yeto_trace(out: Path, layout, published: dict, result) -> Trace:
    from syncer.tape import read_tape

    trace = Trace(thetas={k: layout.unflatten(v) for k, v in published.items()})
    for island in result.islands:
        rows = [json.loads(line) for line in
                (out / "islands" / island / "metrics.jsonl").read_text().splitlines()]
        trace.losses[island] = {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}
    for rec in read_tape(out / "syncer" / "tape.jsonl"):
        if rec["event"] == "merge":
            for s in rec["responders"]:
                trace.tokens.setdefault(s["learner"], []).append(s["tokens"])
    trace.eval_loss = None if math.isnan(result.eval_loss) else result.eval_loss  # no eval
    return trace


# ---- comparing ------------------------------------------------------------------------
def round_losses(trace: Trace, case: Case) -> dict[str, list[float]]:
    """Per island, the training loss of the last inner step of each round (the step
    each push follows)."""
    return {i: [by_step[t * case.sync_every] for t in range(1, case.rounds + 1)]
            for i, by_step in trace.losses.items()}


def theta_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """max over tensors of max|a − b| / max|b| (0 where both are 0)."""
    worst = 0.0
    for name, y in b.items():
        diff = float(np.abs(a[name].astype(np.float64) - y).max())
        scale = float(np.abs(y).max())
        worst = max(worst, diff / scale if scale else diff)
    return worst


def differences(ref: Trace, yeto: Trace, case: Case) -> dict[str, float]:
    """The largest relative differences: of a round's training loss (any island, any
    round) and of Θ (any round, start and final included)."""
    la, lb = round_losses(ref, case), round_losses(yeto, case)
    loss = max(abs(x - y) / abs(y) for i in lb for x, y in zip(la[i], lb[i]))
    theta = max(theta_rel(ref.thetas[w], yeto.thetas[w]) for w in yeto.thetas)
    return dict(loss=loss, theta=theta)


# ---- the command ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m yeto.testing.reference_diloco",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Case()
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--data", required=True, help="training data (as the islands' --data)")
    p.add_argument("--eval-data", default=None, help="held-out data: the final loss")
    p.add_argument("--eval-blocks", type=int, default=d.eval_blocks,
                   help="held-out blocks evaluated (0 = all)")
    p.add_argument("--tuning", choices=("lora", "full"), default=d.tuning)
    p.add_argument("--islands", type=int, default=d.islands, metavar="K", help="replicas")
    p.add_argument("--rounds", type=int, default=d.rounds, metavar="T", help="outer steps")
    p.add_argument("--sync-every", type=int, default=d.sync_every, metavar="H",
                   help="inner steps per round")
    for name in ("seq_len", "batch_size", "lora_r", "seed", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lora_alpha", "inner_lr", "weight_decay", "outer_lr", "outer_momentum"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--token-weights", action="store_true",
                   help="weigh each δ by its replica's loss tokens (yeto's --merge mean)")
    p.add_argument("--q4", action="store_true",
                   help="each δ through yeto's q4 wire with error feedback")
    p.add_argument("--overlap", type=int, default=0, metavar="D",
                   help="replicas train D steps on while a round commits, and keep them")
    p.add_argument("--yeto-rounding", action="store_true",
                   help="the Nesterov step's float32 operations in yeto's syncer's order "
                        "(the same step, other rounding)")
    p.add_argument("--yeto", action="store_true",
                   help="also run the case(s) through yeto.sim and compare")
    p.add_argument("--case", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="a case: the flags above with these changes (keys as the flags' "
                        "names with _), e.g. full4:tuning=full,islands=4; repeatable")
    p.add_argument("--out", type=Path, default=Path("runs/reference"), help="output folder")
    return p


def parse_cases(args: argparse.Namespace) -> dict[str, Case]:
    """{name: Case}: the flags alone (name "run"), or each --case over them."""
    fields = {f.name: f for f in dataclasses.fields(Case)}
    base = Case(**{k: v for k, v in vars(args).items() if k in fields})
    if not args.case:
        return {"run": base}
    cases = {}
    for spec in args.case:
        name, _, changes = spec.partition(":")
        edits = {}
        for item in filter(None, changes.split(",")):
            key, _, value = item.partition("=")
            if key not in fields or not value:
                raise SystemExit(f"--case {spec!r}: {item!r} is not KEY=VALUE with KEY one "
                                 f"of {', '.join(fields)}")
            edits[key] = _typed(getattr(base, key), value)
        cases[name] = dataclasses.replace(base, **edits)
    return cases


def _typed(default, value: str):
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if default is None:
        return value
    return type(default)(value)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cases = parse_cases(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    refs, seconds = {}, {}
    for name, case in cases.items():  # every reference first: no yeto run comes before
        t0 = time.perf_counter()
        refs[name] = run_reference(case)
        seconds[name] = time.perf_counter() - t0
        refs[name].save(args.out / name, "reference")
    worst = dict(loss=0.0, theta=0.0)
    for name, case in cases.items():
        if not args.yeto:
            print(f"{name}: reference in {seconds[name]:.1f} s, final held-out loss "
                  f"{refs[name].eval_loss}")
            continue
        t0 = time.perf_counter()
        trace = run_yeto(case, args.out / name / "sim")
        trace.save(args.out / name, "yeto")
        diff = differences(refs[name], trace, case)
        print(f"{name}: max relative difference, round loss {diff['loss']:.2e}, theta "
              f"{diff['theta']:.2e}; final held-out loss reference {refs[name].eval_loss} "
              f"yeto {trace.eval_loss}; reference {seconds[name]:.1f} s, yeto.sim "
              f"{time.perf_counter() - t0:.1f} s")
        worst = {k: max(worst[k], diff[k]) for k in worst}
    if args.yeto:
        print(f"RESULT max_loss_rel={worst['loss']:.3e} max_theta_rel={worst['theta']:.3e} "
              f"cases={len(cases)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
