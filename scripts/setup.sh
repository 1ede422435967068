#!/usr/bin/env bash
# Creates .venv and installs yeto with every extra (torch, mlx, data, tensorboard) and the test tools.
# torch is installed first, pinned, so pip takes the local CPU build instead of
# pulling a multi-GB CUDA build (on a CUDA box, install your CUDA torch first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,all]"
# headless Chromium for the dashboard's browser test (Debian's package; skipped elsewhere)
command -v chromium >/dev/null || ! command -v apt-get >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
} || echo "chromium not installed: the dashboard browser test will skip"
echo "yeto installed in .venv"
