"""The yeto design's own model family (LFM2) and a mixture-of-experts model (Qwen3-MoE)
trained by a torch island and an MLX island together: adapters bit-identical to the
syncer's, as for llama (tests/e2e/test_mlx_island.py)."""

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")

from helpers.archs import model_with_tokenizer  # noqa: E402
from helpers.mixed import mixed_run  # noqa: E402

pytestmark = pytest.mark.mlx


@pytest.mark.parametrize("arch", ["lfm2", pytest.param("qwen3_moe", marks=pytest.mark.long)])
def test_torch_and_mlx_islands_train_arch_together(arch, tiny_llama, tiny_task, tmp_path):
    model = model_with_tokenizer(arch, tiny_llama, tmp_path / "model")
    summaries = mixed_run(model, tiny_task, tmp_path, steps=6, sync_every=3, seq_len=32,
                          batch_size=2, inner_lr="1e-3", lora_r=4)
    for s in summaries.values():
        assert s["pushes"] >= 2 and s["loss_tokens"] > 0
