"""torch vs MLX island parity: LoRA forward, names/shapes/order, loss, AdamW step.

Here: the checks that need no process, server or training (the others:
tests/integration/test_parity.py)."""


import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


import mlx.nn as mnn  # noqa: E402

from yeto.mlx.lora import LoRALinear  # noqa: E402

pytestmark = pytest.mark.mlx


def test_lora_linear_init_is_peft_init():
    ml = LoRALinear(mnn.Linear(400, 30), r=16, alpha=32, key=mx.random.key(3))
    a = np.array(ml.lora_A.weight)
    bound = 1 / np.sqrt(400)  # kaiming_uniform_(a=sqrt(5)) on (r, in)
    assert a.shape == (16, 400) and np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
    assert abs(a.std() - bound / np.sqrt(3)) < 0.05 * bound  # uniform(-b, b): std b/sqrt(3)
    assert not np.array(ml.lora_B.weight).any() and ml.lora_B.weight.shape == (30, 16)
    assert ml.scaling == 2.0
