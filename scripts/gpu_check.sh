#!/usr/bin/env bash
# The GPU check: what only a CUDA machine can show, in one short run (a few minutes on
# one GPU). It installs nothing: run scripts/setup.sh first (on a CUDA box, install
# your CUDA build of torch before it, as setup.sh says).
#
#   1. the tests marked `cuda` (tests/e2e/test_cuda.py): a torch island on the GPU
#      against a local syncer, an FSDP2 island over the GPUs (NCCL), the weights view's
#      pinned staging and the overlapped push on CUDA weights; each ends bit-identical
#      to the syncer or to the same island on CPU;
#   2. the overlapped push and the staged sum (tests/unit/test_async_push.py,
#      tests/unit/test_staged_sum.py: no GPU needed);
#   3. the island benchmark (scripts/bench_island.py --quick): tokens/s of the island
#      ÷ a bare peft loop on the same model and data, and per push the seconds the
#      training loop waited for it (island_blocked_s) beside its background encode's
#      (encode_s), on the GPU;
#   4. the syncer's CPU seconds per round against the memory-bandwidth floor
#      (scripts/bench_memory.py --half-billion --quick: 5e7 parameters, two islands).
#
# Without a GPU, 1 is skipped by pytest (and says so), 3 runs on the CPU instead and
# says so; the last line says what was skipped:
#   RESULT gpu=<0|1> cuda_tests=<passed>/<failed>/<skipped> ... skipped=<what>
# Exit status: 0 when nothing failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run scripts/setup.sh first" >&2; exit 2; }
OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
failed=0
skipped=""
if [ "$GPU" = 1 ]; then
  "$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '×', torch.cuda.device_count())"
  DEVICE=cuda
else
  echo "no CUDA GPU here: the cuda tests are skipped, the island benchmark runs on the CPU"
  DEVICE=cpu
  skipped="cuda_tests,island_bench_on_gpu"
fi

echo "== 1. tests marked cuda"
"$PY" -m pytest tests/e2e/test_cuda.py -m cuda -q -rs -p no:cacheprovider \
  --junitxml="$OUT/cuda.xml" 2>&1 | tail -15
counts=$("$PY" - "$OUT/cuda.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
s = ET.parse(sys.argv[1]).getroot()
s = s if s.tag == "testsuite" else s[0]
n, f, e, k = (int(s.get(x, 0)) for x in ("tests", "failures", "errors", "skipped"))
print(f"{n - f - e - k}/{f + e}/{k}")
EOF
)
[ "${counts#*/}" = "0/${counts##*/}" ] || failed=1

echo "== 2. the overlapped push and the staged sum (CPU)"
"$PY" -m pytest tests/unit/test_async_push.py tests/unit/test_staged_sum.py -q \
  -p no:cacheprovider 2>&1 | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || failed=1

echo "== 3. the island benchmark on $DEVICE"
"$PY" scripts/bench_island.py --quick --device "$DEVICE" 2>&1 | grep -v "Loading weights\|warn" \
  | tee "$OUT/island.txt" | tail -6
island=$(grep '^RESULT' "$OUT/island.txt" | sed 's/^RESULT //') || island=""
[ -n "$island" ] || { failed=1; island="island_bench=failed"; }

echo "== 4. the syncer's CPU per round against the floor (5e7 parameters)"
"$PY" scripts/bench_memory.py --half-billion --quick 2>&1 | tee "$OUT/memory.txt" | tail -8
memory=$(grep '^RESULT' "$OUT/memory.txt" | sed 's/^RESULT //') || memory=""
[ -n "$memory" ] || { failed=1; memory="memory_bench=failed"; }

pick() { echo "$1" | tr ' ' '\n' | grep "^$2=" | head -1; }
echo "RESULT gpu=$GPU cuda_tests=$counts island_$(pick "$island" ratio) \
$(pick "$island" island_blocked_s) $(pick "$island" encode_s) device=$DEVICE \
$(pick "$memory" cpu_over_floor) synthetic_$(pick "$memory" island_blocked_s) \
synthetic_$(pick "$memory" encode_s) failed=$failed skipped=${skipped:-none}"
exit $failed
