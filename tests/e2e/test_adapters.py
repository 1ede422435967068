"""peft <-> mlx-lm adapter conversion (numpy only; no mlx needed).

Here: the checks that need real processes (the others: tests/unit/test_adapters.py,
tests/integration/test_adapters.py)."""


import json
import subprocess
import sys
from pathlib import Path


def test_adapter_config_needs_neither_torch_nor_peft():
    """The MLX island and the syncer write it where torch and peft are not installed;
    the text does not depend on the order of target_modules."""
    code = ("import sys\nfor m in ('torch', 'peft', 'transformers', 'mlx'): sys.modules[m] = None\n"
            "from yeto.interop.adapters import peft_adapter_config as c\n"
            "a = c('m', 4, 8.0, ['b', 'a'])\nassert a == c('m', 4, 8.0, ('a', 'b'))\nprint(a)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["target_modules"] == ["a", "b"] and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["peft_type"] == "LORA" and cfg["inference_mode"] is True
