"""The house rules the layout promises: a backend-free core, short functions and
classes, --help without measured figures, a library that never imports its CLI.

Here: the checks that need real processes (the others: tests/unit/test_house.py)."""


from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


CORE = ["yeto", "yeto.layout", "yeto.codec", "yeto.targets", "yeto.frozen", "yeto.transport",
        "yeto.island", "yeto.config", "yeto.loop", "yeto.net", "yeto.io", "yeto.signals",
        "yeto.metrics", "yeto.data", "yeto.data.provenance", "yeto.interop.adapters"]


BACKENDS = ("torch", "transformers", "peft", "mlx", "mlx_lm", "grpc", "datasets")


def test_the_core_imports_with_numpy_alone():
    """The top level of yeto/ (and data, adapter files) needs no backend and no gRPC."""
    code = ("import sys\n"
            f"for m in {BACKENDS!r}: sys.modules[m] = None\n"
            f"import importlib\nfor m in {CORE!r}: importlib.import_module(m)\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_the_blocked_backends_are_really_blocked():
    """The test above would prove nothing if blocking did not stop an import."""
    code = "import sys\nsys.modules['torch'] = None\nimport torch\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "torch" in r.stderr
