"""The MLX island: config shim, outputs (peft + mlx-lm adapters), a mixed
torch + MLX run against a real syncer process.

Here: the checks that need no process, server or training (the others:
tests/integration/test_mlx_island.py, tests/e2e/test_mlx_island.py)."""


import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


from yeto.mlx.config import flat_rope_overrides  # noqa: E402

pytestmark = pytest.mark.mlx


# ---- config translation -----------------------------------------------------
def test_flat_rope_overrides():
    nested = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    assert flat_rope_overrides(nested) == {"rope_theta": 5e5}
    assert flat_rope_overrides({**nested, "rope_theta": 1e4}) == {}  # a flat value wins
    yarn = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}
    assert flat_rope_overrides(yarn) == {  # "type" too, for mlx-lm files that read it
        "rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "type": "yarn"}}
    per_layer = {"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                      "sliding_attention": {"rope_theta": 1e4}}}
    assert flat_rope_overrides(per_layer) == {"rope_theta": 1e6}  # the full-attention layers'
    assert flat_rope_overrides(per_layer, reads_layered=True) == {}  # the model reads them
    vlm = {"text_config": {"hidden_size": 8, **nested}}
    assert flat_rope_overrides(vlm) == {"text_config": {"hidden_size": 8, **nested,
                                                        "rope_theta": 5e5}}
