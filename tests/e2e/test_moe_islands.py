"""A torch island and an MLX island train a tiny mixture-of-experts model with LoRA on
its fused expert weights (``--lora-targets all-linear``: peft's target_parameters on
torch, `yeto.mlx.experts.ExpertLoRA` on MLX) through a real syncer: the expert
adapters train, are merged like any tensor, and end bit-identical on both islands and
the syncer (tests/helpers/mixed.py checks the last)."""

import json

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")

from helpers.archs import model_with_tokenizer  # noqa: E402
from helpers.mixed import mixed_run  # noqa: E402

pytestmark = pytest.mark.mlx


@pytest.mark.slow
def test_torch_and_mlx_islands_train_expert_lora_together(tiny_llama, tiny_task, tmp_path):
    from safetensors.numpy import load_file

    model = model_with_tokenizer("qwen3_moe", tiny_llama, tmp_path / "model")
    summaries = mixed_run(model, tiny_task, tmp_path, steps=6, sync_every=3, seq_len=32,
                          batch_size=2, inner_lr="1e-3", lora_r=4, targets="all-linear")
    for s in summaries.values():
        assert s["pushes"] >= 2 and s["loss_tokens"] > 0
    final = tmp_path / "s" / "final"
    tensors = load_file(str(final / "adapter_model.safetensors"))
    experts = {k: v for k, v in tensors.items() if ".mlp.experts." in k}
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert len(experts) == layers * 2 * 2  # gate_up_proj and down_proj, A and B
    # lora_B starts at zero: non-zero means the experts trained and were merged
    assert all(np.abs(v).max() > 0 for k, v in experts.items() if ".lora_B." in k)
    assert not any(".mlp.gate." in k for k in tensors)  # the router stayed frozen
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert len(cfg["target_parameters"]) == layers * 2
    # the MLX island's mlx-lm copy has the experts (LoRASwitchLinear keys)
    mlx_cfg = json.loads((tmp_path / "island-1" / "mlx" / "adapter_config.json").read_text())
    assert "mlp.switch_mlp.down_proj" in mlx_cfg["lora_parameters"]["keys"]
