#!/usr/bin/env bash
# GPU check of every Triton kernel (correctness vs reference, then timings vs torch; < 8 minutes).
# Uses the machine's own python/torch/triton; installs nothing. Run from anywhere:
#   bash bench/gpu_check.sh            # on a CUDA machine; output also saved under bench/results/
#   bash bench/gpu_check.sh --dry-run  # CPU + Triton interpreter, tiny shapes (no GPU needed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then PY="$ROOT/.venv/bin/python"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # bench/ and, if not installed, the sources
export HF_HUB_OFFLINE=1
STAMP="$(date -u +%Y-%m-%d)"
if [[ " $* " == *" --dry-run "* ]]; then
  exec timeout 480 "$PY" -m bench.gpu_check "$@"
fi
MACHINE="$("$PY" -c 'import torch, platform, os; n = torch.cuda.get_device_name().lower().replace(" ", "_") if torch.cuda.is_available() else "nogpu"; print(f"{platform.machine()}-{n}")')"
OUT="bench/results/gpu_check-${MACHINE}-${STAMP}.md"
mkdir -p bench/results
set +e
timeout 480 "$PY" -m bench.gpu_check "$@" 2>&1 | tee "$OUT"
rc=${PIPESTATUS[0]}
set -e
echo "saved: $OUT (exit $rc)"
exit "$rc"
