"""What the adapters tests in more than one tier share."""

import json
from pathlib import Path

import numpy as np

from yeto.interop.adapters import (
    peft_adapter_config,
    save_peft_adapter,
)

KEYS = ("mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj")


SHAPES = {"mlp.down_proj": (256, 128), "self_attn.q_proj": (128, 128),
          "self_attn.v_proj": (128, 64)}  # (in, out)


def make_peft(out: Path, base: Path, layers=(0, 1, 2), r=4, alpha=8.0, keys=KEYS,
              seed=0, **cfg_changes) -> Path:
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in layers:
        for k in keys:
            fan_in, fan_out = SHAPES[k]
            m = f"base_model.model.model.layers.{i}.{k}"
            tensors[f"{m}.lora_A.weight"] = rng.standard_normal((r, fan_in)).astype(np.float32)
            tensors[f"{m}.lora_B.weight"] = rng.standard_normal((fan_out, r)).astype(np.float32)
    modules = [f"model.layers.{i}.{k}" for i in layers for k in keys]
    cfg = json.loads(peft_adapter_config(str(base), r, alpha, modules))
    cfg.update(cfg_changes)
    return save_peft_adapter(out, tensors, json.dumps(cfg, indent=2, sort_keys=True))
