#!/usr/bin/env python
"""yeto against torchft's DiLoCo, on the same batches, with DiLoCo's Algorithm 1 as the
judge.

Three runs of one case (k replicas, H AdamW steps per round, outer SGD: plain averaging,
or Nesterov at lr 0.7, momentum 0.9), each replica on the batches yeto's island i draws:

  reference   yeto.testing.reference_diloco: Algorithm 1 in plain torch, one process
  yeto        `yeto.sim` (k islands and the syncer in one process), `--blocking-sync`,
              f32 both ways, `--merge uniform`
  torchft     `torchft.local_sgd.DiLoCo` as torchft's own integration tests run it: k
              replica groups as threads of this process, each with its own TCPStore,
              `ProcessGroupGloo` and `Manager` (use_async_quorum=False), around one
              real `LighthouseServer`; the replica's model, AdamW, batches and loss are
              the reference's (`reference_diloco.Replica`)

and, to say where each difference comes from, three more:

  torchft init_sync=False        torchft with `Manager(init_sync=False)`
  reference + init_sync healing  the reference, where at the end of round 1 every
                                 replica but the first takes the first's weights and
                                 AdamW state, as torchft's Manager heals them at its
                                 first quorum when init_sync is True (its default)
  reference, yeto's rounding     the reference with `--yeto-rounding` (the Nesterov
                                 step's float32 operations in yeto's syncer's order)

Per round it prints each run's training loss (the mean over replicas of the loss at the
last inner step) and how far each run's Θ is from the reference's, and from its model;
then the final held-out loss. Last line, per outer optimizer:
`RESULT outer=… max_round_loss_diff=… final_loss_torchft=… final_loss_yeto=…`
(max_round_loss_diff: the largest |torchft − yeto| of one replica's loss at a push).

torchft is an optional benchmark dependency, never one of yeto's. Install it in a
venv of its own that reuses this checkout's packages (torch among them):

    python -m venv /tmp/tft
    echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > /tmp/tft/lib/python3.11/site-packages/yeto-venv.pth
    /tmp/tft/bin/pip install torchft==0.2.0
    /tmp/tft/bin/python scripts/compare_torchft.py --out runs/torchft

Without --model / --data the tiny model and task are built into --out (offline).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's yeto, syncer

from yeto.testing import reference_diloco as rd  # noqa: E402

TIMEOUT = timedelta(seconds=120)  # every torchft wait (quorum, collectives, connects)


# ---- torchft ------------------------------------------------------------------------------
def run_torchft(case: rd.Case, init_sync: bool = True) -> rd.Trace:
    """k torchft replicas (threads) around one lighthouse; Θ read after each sync."""
    import torch
    from torchft._torchft import LighthouseServer
    from transformers import AutoTokenizer

    torch.set_num_threads(case.threads)
    tok = AutoTokenizer.from_pretrained(case.model)
    replicas = [rd.Replica(case, i, tok) for i in range(case.islands)]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=case.islands,
                                  join_timeout_ms=100)
    try:
        with ThreadPoolExecutor(case.islands, thread_name_prefix="replica") as pool:
            done = [pool.submit(_replica_main, case, i, r, lighthouse.address(), init_sync)
                    for i, r in enumerate(replicas)]
            thetas = [f.result(timeout=TIMEOUT.total_seconds() * case.rounds) for f in done]
    finally:
        lighthouse.shutdown()
    trace = rd.Trace(thetas=thetas[0])
    trace.losses = {f"island-{i}": dict(r.losses) for i, r in enumerate(replicas)}
    if case.eval_data:
        trace.eval_loss = rd.evaluate(case, replicas[0], tok)
    return trace


def _replica_main(case: rd.Case, i: int, replica: rd.Replica, lighthouse: str,
                  init_sync: bool) -> dict[str, dict[str, np.ndarray]]:
    """One replica group (one rank): train R × H steps under torchft's DiLoCo; returns
    its Θ at the start and after each sync."""
    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore(host_name="localhost", port=0, is_master=True,
                          wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=case.islands,
        use_async_quorum=False, init_sync=init_sync, replica_id=str(i),
        load_state_dict=lambda sd: (replica.model.load_state_dict(sd["model"]),
                                    replica.opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": replica.model.state_dict(),
                            "optim": replica.opt.state_dict()},
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT)
    outer = torch.optim.SGD(list(replica.params.values()), lr=case.outer_lr,
                            momentum=case.outer_momentum, nesterov=case.outer_momentum > 0)
    thetas, steps = {"0": _weights(replica)}, [0]

    def after_step(*_) -> None:  # registered after DiLoCo's hook: runs after its sync
        steps[0] += 1
        if steps[0] % case.sync_every == 0:
            thetas[str(steps[0] // case.sync_every)] = _weights(replica)

    try:
        with DiLoCo(manager, [replica.model], replica.opt, outer,
                    sync_every=case.sync_every, backup_device=torch.device("cpu")):
            hook = replica.opt.register_step_post_hook(after_step)
            replica.train(case.rounds * case.sync_every)
            hook.remove()
    finally:
        manager.shutdown(wait=False)
    thetas["final"] = thetas[str(case.rounds)]
    return thetas


def _weights(replica: rd.Replica) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in replica.params.items()}


def init_sync_healing(t: int, i: int, replicas: list[rd.Replica]) -> None:
    """What torchft's Manager does at its first quorum with init_sync=True (DiLoCo's
    first quorum comes at the end of round 1, before the pseudo-gradients are taken):
    every replica but the first loads the first's state (`Manager._async_quorum`:
    `heal`, then `_apply_pending_state_dict`), here its model and AdamW state."""
    if t == 1 and i > 0:
        replicas[i].model.load_state_dict(replicas[0].model.state_dict())
        replicas[i].opt.load_state_dict(copy.deepcopy(replicas[0].opt.state_dict()))


# ---- the comparison --------------------------------------------------------------------
def compare(case: rd.Case, out: Path) -> dict:
    """Every run of one case; prints the per-round table; returns the RESULT figures."""
    runs, seconds = {}, {}
    for name, fn in RUNS.items():
        t0 = time.perf_counter()
        runs[name] = fn(case, out)
        seconds[name] = time.perf_counter() - t0
        runs[name].save(out, "".join(c if c.isalnum() else "_" for c in name))
    print_table(case, runs)
    print("seconds: " + ", ".join(f"{n} {s:.0f}" for n, s in seconds.items()))
    tf, ye = rd.round_losses(runs["torchft"], case), rd.round_losses(runs["yeto"], case)
    return dict(max_round_loss_diff=max(abs(a - b) for i in ye for a, b in zip(tf[i], ye[i])),
                final_loss_torchft=runs["torchft"].eval_loss,
                final_loss_yeto=runs["yeto"].eval_loss,
                final_loss_reference=runs["reference"].eval_loss)


# name: (case, out) -> Trace; the sim runs last (after it, nothing else runs here)
RUNS = {
    "reference": lambda c, out: rd.run_reference(c),
    "reference + init_sync healing": lambda c, out: rd.run_reference(c, init_sync_healing),
    "reference, yeto's rounding": lambda c, out: rd.run_reference(
        dataclasses.replace(c, yeto_rounding=True)),
    "torchft": lambda c, out: run_torchft(c),
    "torchft init_sync=False": lambda c, out: run_torchft(c, init_sync=False),
    "yeto": lambda c, out: rd.run_yeto(c, out / "sim"),
}
# (run, the run it is held against): Θ's largest relative difference, per round
PAIRS = [("torchft", "reference"), ("yeto", "reference"),
         ("torchft", "reference + init_sync healing"),
         ("torchft init_sync=False", "reference"), ("yeto", "reference, yeto's rounding")]


def print_table(case: rd.Case, runs: dict[str, rd.Trace]) -> None:
    """Per round: each run's mean training loss at the push; Θ of each pair apart."""
    losses = {n: rd.round_losses(t, case) for n, t in runs.items()}
    print("training loss at each push (mean over replicas), by round: " +
          "; ".join(f"({j}) {n}" for j, n in enumerate(runs, 1)))
    print("round | " + " | ".join(f"{f'({j})':>9}" for j in range(1, len(runs) + 1)))
    for t in range(1, case.rounds + 1):
        print(f"{t:>5} | " + " | ".join(
            f"{np.mean([v[t - 1] for v in losses[n].values()]):>9.5f}" for n in runs))
    print("Θ's largest relative difference after each round: " +
          "; ".join(f"[{j}] {a} vs {b}" for j, (a, b) in enumerate(PAIRS, 1)))
    print("round | " + " | ".join(f"{f'[{j}]':>9}" for j in range(1, len(PAIRS) + 1)))
    for t in range(1, case.rounds + 1):
        print(f"{t:>5} | " + " | ".join(
            f"{rd.theta_rel(runs[a].thetas[str(t)], runs[b].thetas[str(t)]):>9.2e}"
            for a, b in PAIRS))
    print("final held-out loss: " + "; ".join(
        f"{n} {runs[n].eval_loss:.5f}" for n in runs if runs[n].eval_loss is not None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/compare_torchft.py",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=argparse.SUPPRESS,
                   help="local model folder (default: the tiny one)")
    p.add_argument("--data", default=argparse.SUPPRESS,
                   help="training data (default: the tiny task)")
    p.add_argument("--eval-data", default=argparse.SUPPRESS,
                   help="held-out data (default: the task's)")
    p.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks (0 = all)")
    p.add_argument("--tuning", choices=("lora", "full"), default="full",
                   help="what the replicas train")
    p.add_argument("--islands", type=int, default=2, metavar="K", help="replicas")
    p.add_argument("--rounds", type=int, default=10, metavar="T", help="outer rounds")
    p.add_argument("--sync-every", type=int, default=20, metavar="H",
                   help="inner steps per round")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per block")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per inner step")
    p.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=3, help="seed of the model and the batches")
    p.add_argument("--outer", choices=("average", "nesterov", "both"), default="both",
                   help="plain averaging (lr 1, momentum 0), Nesterov (lr 0.7, momentum "
                        "0.9), or each in turn")
    p.add_argument("--out", type=Path, default=Path("runs/torchft"), help="output folder")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, data = getattr(args, "model", None), getattr(args, "data", None)
    eval_data = getattr(args, "eval_data", None)
    if model is None or data is None:
        from yeto.testing.tasks import make_task
        from yeto.testing.tiny import make_tiny_model

        model = model or str(make_tiny_model(args.out / "model", "llama"))
        train, held_out = make_task(args.out / "task")
        data, eval_data = data or str(train), eval_data or str(held_out)
    base = rd.Case(model=model, data=data, eval_data=eval_data, eval_blocks=args.eval_blocks,
                   tuning=args.tuning, islands=args.islands, rounds=args.rounds,
                   sync_every=args.sync_every, seq_len=args.seq_len,
                   batch_size=args.batch_size, inner_lr=args.inner_lr, seed=args.seed)
    outers = {"average": (1.0, 0.0), "nesterov": (0.7, 0.9)}
    results = []
    for name in outers if args.outer == "both" else [args.outer]:
        lr, momentum = outers[name]
        case = dataclasses.replace(base, outer_lr=lr, outer_momentum=momentum)
        print(f"== {name}: k={case.islands}, H={case.sync_every}, {case.rounds} rounds, "
              f"{case.tuning}, outer lr {lr} momentum {momentum}")
        results.append((name, compare(case, args.out / name)))
    for name, r in results:
        print(f"RESULT outer={name} max_round_loss_diff={r['max_round_loss_diff']:.6f} "
              f"final_loss_torchft={r['final_loss_torchft']:.5f} "
              f"final_loss_yeto={r['final_loss_yeto']:.5f} "
              f"final_loss_reference={r['final_loss_reference']:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
