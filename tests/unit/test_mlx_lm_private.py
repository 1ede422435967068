"""The private mlx-lm names yeto relies on still exist and do what yeto relies on.

mlx-lm may change a private name in any release; each test here fails with a message
that names the installed mlx-lm version and what changed, so that an mlx-lm upgrade
breaks here, loudly, and not as wrong logits somewhere else. Every private name yeto
uses has a test here, and `test_yeto_imports_no_other_private_mlx_lm_name` keeps the
list closed:

- ``mlx_lm.utils._get_classes``, called only by `yeto.mlx.config.mlx_lm_classes`
  (mlx-lm picks a model's ``Model`` and ``ModelArgs`` with it; nothing public does);
- ``YarnRoPE._freqs`` (``mlx_lm.models.rope_utils``), the frequencies
  `yeto.mlx.rope` sets for a yarn RoPE that transformers does not truncate.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")

import mlx_lm  # noqa: E402

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parents[2]
#: (module that imports it, private mlx-lm name): each has its test in this file
ALLOWED = {("yeto.mlx.config", "mlx_lm.utils._get_classes")}


def changed(what: str) -> str:
    return (f"mlx-lm {mlx_lm.__version__} changed {what}, which yeto relies on: "
            "adapt the place named in tests/unit/test_mlx_lm_private.py's docstring")


def test_get_classes_picks_the_model_module_of_a_model_type():
    import mlx_lm.utils
    from mlx_lm.models import llama

    get_classes = getattr(mlx_lm.utils, "_get_classes", None)
    assert callable(get_classes), changed("mlx_lm.utils._get_classes (gone)")
    assert list(inspect.signature(get_classes).parameters) == ["config"], changed(
        f"the parameters of mlx_lm.utils._get_classes{inspect.signature(get_classes)}")
    default = inspect.signature(mlx_lm.utils.load_model).parameters.get("get_model_classes")
    assert default is not None and default.default is get_classes, changed(
        "mlx_lm.utils.load_model's get_model_classes default (no longer _get_classes)")
    assert get_classes({"model_type": "llama"}) == (llama.Model, llama.ModelArgs), changed(
        "what mlx_lm.utils._get_classes returns (not mlx_lm.models.<type>'s Model, ModelArgs)")
    assert get_classes({"model_type": "mistral"}) == (llama.Model, llama.ModelArgs), changed(
        "mlx_lm.utils._get_classes's model type remapping (mistral -> llama)")
    with pytest.raises(ValueError):
        get_classes({"model_type": "no_such_model_type"})


def test_mlx_lm_classes_is_what_mlx_lm_loads_with():
    import mlx_lm.utils

    from yeto.mlx.config import mlx_lm_classes, mlx_model_module

    for config in ({"model_type": "qwen3"}, {"model_type": "mistral"}):
        assert mlx_lm_classes(config) == mlx_lm.utils._get_classes(config)
    assert mlx_model_module({"model_type": "mistral"}).__name__ == "mlx_lm.models.llama"


def test_yarn_rope_rotates_with_its_freqs_attribute():
    import mlx.core as mx
    from mlx_lm.models.rope_utils import YarnRoPE

    rope = YarnRoPE(8, scaling_factor=4.0)
    assert isinstance(getattr(rope, "_freqs", None), mx.array), changed(
        "YarnRoPE._freqs (gone)")
    assert rope._freqs.shape == (4,), changed(f"YarnRoPE._freqs's shape {rope._freqs.shape}")
    x = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    before = rope(x, offset=3)
    rope._freqs = rope._freqs * 2
    assert not mx.allclose(before, rope(x, offset=3)).item(), changed(
        "YarnRoPE's rotation (it no longer rotates with self._freqs)")


def _private_mlx_lm_imports(path: Path) -> set[str]:
    """``mlx_lm.<module>.<_name>`` for each private mlx-lm name the file imports or
    reads as an attribute of an imported mlx-lm module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
            if any(part.startswith("_") for part in node.module.split(".")):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mlx_lm")
                      and any(p.startswith("_") for p in a.name.split("."))}
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base.startswith("mlx_lm"):
                found.add(f"{base}.{node.attr}")
    return found


def test_yeto_imports_no_other_private_mlx_lm_name():
    used = set()
    for path in sorted((ROOT / "yeto").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        used |= {(module, name) for name in _private_mlx_lm_imports(path)}
    assert used <= ALLOWED, (f"private mlx-lm names without a test here: {sorted(used - ALLOWED)}"
                             " (add one, and the name to ALLOWED)")
    assert used == ALLOWED, f"no longer used, drop from ALLOWED: {sorted(ALLOWED - used)}"
