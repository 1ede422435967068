"""What LoRA on mixture-of-experts experts costs in memory.

Two measurements, each beside its baseline (attention-only LoRA, what ``auto`` picks
on a MoE model) in the same run:

  adapter   peft's LoRA tensors on a meta-device model of real configurations
            (Qwen3-30B-A3B, Mixtral-8x7B), r=16: bytes of the trainable tensors with
            ``--lora-targets auto`` and ``all-linear``, and the expert tensors' bytes
            beside the formula r·(in+out)·E·4 B per fused weight.
  process   one island's peak RSS (VmHWM) while attaching LoRA, and (the peak reset
            after attaching) over two AdamW steps, each minus its RSS after loading
            the model, on a two-layer model with Qwen3-30B-A3B's per-layer
            dimensions but fewer experts (--experts, default 32; random weights),
            torch (peft) and MLX, auto and all-linear. The difference is what the
            expert adapters cost a training island: the factors, their gradients, the
            two AdamW moments, and what the backend computes them with (peft's
            ParamWrapper adds B·A into a full copy of each fused weight per forward).
            The MLX rows also give the peak of MLX's own allocator over the steps
            (``mx.get_peak_memory``, from its active memory after attaching): MLX
            reuses freed buffers, so RSS undercounts what its training allocates;
            the MLX expert figure in the RESULT line is that one.

Last line: RESULT ratio=<torch all-linear extra / auto extra> key=value ...
(--quick: the adapter table only, ratio = Qwen3-30B-A3B's all-linear / auto bytes.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench import MIB, ROOT, parser, result_line

from yeto.display import print_table

R, ALPHA = 16, 32.0
REAL = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936)),
    "Mixtral-8x7B": ("mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000)),
}


def adapter_rows() -> list[dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.torch.model import attach_lora

    rows = []
    for name, (arch, kw) in REAL.items():
        row = {"model": name}
        for targets in ("auto", "all-linear"):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw))
                fused = {n: p.shape for n, p in model.named_parameters() if p.ndim == 3}
                model = attach_lora(model, R, ALPHA, targets, seed=0)
            lora = {n: p.numel() * 4 for n, p in model.named_parameters() if p.requires_grad}
            row[targets] = sum(lora.values())
            row["experts"] = sum(v for n, v in lora.items() if ".experts." in n)
        # transformers' fused weights are (E, out, in)
        row["formula"] = sum(R * (s[1] + s[2]) * s[0] * 4 for s in fused.values())
        rows.append(row)
    return rows


# ---- process memory --------------------------------------------------------------
def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> int:
    """The peak RSS so far (KiB); then the kernel's peak is reset to the current RSS."""
    peak = _kib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")
    return peak


def worker(backend: str, model_dir: str, targets: str) -> dict:
    """In a subprocess: load, note RSS, attach, two AdamW steps, report peak - base."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(3, 1000, (1, 129))
    weights = np.ones((1, 128), dtype=np.float32)
    if backend == "torch":
        import torch

        from yeto.torch.model import attach_lora, load_base

        torch.set_num_threads(1)
        model, _ = load_base(model_dir)
        base = _kib("VmRSS")
        model = attach_lora(model, R, ALPHA, targets, seed=0)
        attach = _reset_peak() - base
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.from_numpy(tokens)
        for _ in range(2):
            model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import mlx.core as mx

        from yeto.mlx.learner import hf_weight_names, make_loss_and_grad, make_optimizer, train_step
        from yeto.mlx.load import load_model, read_config
        from yeto.mlx.lora import attach_lora

        model, _ = load_model(model_dir)
        base = _kib("VmRSS")
        attach_lora(model, read_config(Path(model_dir)), R, ALPHA, targets, 0,
                    hf_weight_names=hf_weight_names(Path(model_dir)))
        attach = _reset_peak() - base
        mx.clear_cache()  # MLX keeps freed buffers for reuse, unseen by RSS: its own count
        mx.reset_peak_memory()
        active = mx.get_active_memory()
        opt, step = make_optimizer(1e-4, 0.0), make_loss_and_grad(model)
        for _ in range(2):
            train_step(model, opt, [(tokens, weights)], step)
        mlx_mib = (mx.get_peak_memory() - active) / MIB
        return {"base_mib": base / 1024, "attach_mib": attach / 1024,
                "extra_mib": (_kib("VmHWM") - base) / 1024, "alloc_mib": mlx_mib}
    return {"base_mib": base / 1024, "attach_mib": attach / 1024,
            "extra_mib": (_kib("VmHWM") - base) / 1024}


def process_rows(experts: int) -> list[dict]:
    from yeto.testing.archs import tiny_model

    kw = dict(REAL["Qwen3-30B-A3B"][1], num_experts=experts, num_hidden_layers=2,
              vocab_size=1024, num_experts_per_tok=min(8, experts))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        tiny_model("qwen3_moe", tmp, overrides=kw)
        for backend in ("torch", "mlx"):
            for targets in ("auto", "all-linear"):
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", backend, tmp, targets],
                    capture_output=True, text=True, cwd=ROOT,
                    env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1800)
                if out.returncode != 0:
                    raise RuntimeError(f"{backend} {targets}: {out.stderr[-2000:]}")
                rows.append({"backend": backend, "targets": targets,
                             **json.loads(out.stdout.strip().splitlines()[-1])})
        adapter = experts * 2 * R * ((2048 + 2 * 768) + (768 + 2048)) * 4 / MIB
    return rows, adapter


def expert_mib(rows: list[dict]) -> dict[str, float]:
    """{<model>_expert_mib: MiB of its expert adapter} for the RESULT line."""
    return {f"{r['model'].lower()}_expert_mib": r["experts"] / MIB for r in rows}


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32,
                   help="experts of the two-layer model the islands train")
    p.add_argument("--worker", nargs=3, metavar=("BACKEND", "MODEL", "TARGETS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    rows = adapter_rows()
    print_table(["model", "auto MiB", "all-linear MiB", "ratio", "experts MiB",
                 "formula MiB"],
                [[r["model"], f"{r['auto'] / MIB:.1f}", f"{r['all-linear'] / MIB:.1f}",
                  f"{r['all-linear'] / r['auto']:.1f}", f"{r['experts'] / MIB:.1f}",
                  f"{r['formula'] / MIB:.1f}"] for r in rows])
    if args.quick:
        print("--quick: the adapter table only (the islands' process memory takes minutes)")
        print(result_line(rows[0]["all-linear"] / rows[0]["auto"], **expert_mib(rows)))
        return 0
    experts = args.experts
    proc, adapter = process_rows(experts)
    print(f"\ntwo layers of Qwen3-30B-A3B's dimensions, {experts} experts, r={R}: the expert "
          f"adapter is {adapter:.1f} MiB (formula); x4 with its gradient and AdamW's moments "
          f"= {4 * adapter:.1f} MiB")
    print_table(["backend", "targets", "RSS after load MiB", "attach: peak - load MiB",
                 "training: peak - load MiB", "MLX allocator: training peak - start MiB"],
                [[r["backend"], r["targets"], f"{r['base_mib']:.0f}", f"{r['attach_mib']:.1f}",
                  f"{r['extra_mib']:.1f}", f"{r['alloc_mib']:.1f}" if "alloc_mib" in r else "-"]
                 for r in proc])
    extra = {(r["backend"], r["targets"]): r.get("alloc_mib", r["extra_mib"]) for r in proc}
    torch_experts = extra[("torch", "all-linear")] - extra[("torch", "auto")]
    mlx_experts = extra[("mlx", "all-linear")] - extra[("mlx", "auto")]
    print(result_line(extra[("torch", "all-linear")] / extra[("torch", "auto")],
                      torch_expert_mib=torch_experts, mlx_expert_mib=mlx_experts,
                      expert_adapter_mib=adapter, experts=experts, **expert_mib(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
