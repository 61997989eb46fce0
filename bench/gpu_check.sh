#!/usr/bin/env bash
# GPU check in one command, at most ~4 minutes on one GPU: the kernels' configurations autotuned and timed against
# their roofline bounds, the Triton kernels' correctness, 2 training steps of
# the tiny run for every estimator / ablation on CUDA, one quickstart-like AlignOPSD step, then the kernel timings.
# Each part runs in its own process under its own timeout (one slow part cannot eat the others' time) and
# appends its lines to the results file as they are known, so a run that is cut off keeps what it finished.
# Uses the machine's own python/torch/triton/transformers; installs and downloads nothing. Run from anywhere:
#   bash bench/gpu_check.sh            # CUDA; results in bench/results/gpu_check-<machine>-<date>.md
#   bash bench/gpu_check.sh --dry-run  # CPU + Triton interpreter, tiny shapes, the same code (a few minutes)
# Environment: PYTHON (interpreter), GPU_CHECK_OUT (results file), GPU_CHECK_TOTAL_S (overall budget, seconds).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then PY="$ROOT/.venv/bin/python"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # bench/ and, if not installed, the sources
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
STAMP="$(date -u +%Y-%m-%d)"
if [[ " $* " == *" --dry-run "* ]]; then
  # part budgets (s): configs, kernels, engine, scale, timing -- a loaded 2-core CPU
  BUDGETS=(60 120 240 90 60); TOTAL="${GPU_CHECK_TOTAL_S:-540}"
  OUT="${GPU_CHECK_OUT:-${TMPDIR:-/tmp}/gpu_check-dryrun-$(uname -m)-${STAMP}.md}"
else
  BUDGETS=(40 55 80 30 30); TOTAL="${GPU_CHECK_TOTAL_S:-235}"
  GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr 'A-Z ' 'a-z_')"
  OUT="${GPU_CHECK_OUT:-bench/results/gpu_check-$(uname -m)-${GPU:-nogpu}-${STAMP}.md}"
fi
mkdir -p "$(dirname "$OUT")"
echo "# GPU check run $(date -u +%Y-%m-%dT%H:%M:%SZ) (budget ${TOTAL} s; args: $*)" | tee -a "$OUT"
RC=0
PARTS=(configs kernels engine scale timing)
for i in 0 1 2 3 4; do
  part="${PARTS[$i]}"
  left=$((TOTAL - SECONDS))
  t=$(( BUDGETS[i] < left ? BUDGETS[i] : left ))
  if (( t < 10 )); then
    echo "[SKIP] part $part: no time left in the ${TOTAL} s budget" | tee -a "$OUT"; RC=1; continue
  fi
  # the part's own budget ends 15 s before its timeout: engine cases and timings past it are skipped cleanly
  timeout -k 5 "$t" "$PY" -m bench.gpu_check --part "$part" --out "$OUT" --budget $((t > 30 ? t - 15 : t / 2)) "$@"
  rc=$?
  if (( rc == 124 || rc == 137 )); then
    echo "[FAIL] part $part: cut off by its ${t} s timeout (the lines above are what it finished)" | tee -a "$OUT"
  elif (( rc != 0 )); then
    echo "[FAIL] part $part: exit status $rc" | tee -a "$OUT"
  fi
  (( rc != 0 )) && RC=1
done
echo "total ${SECONDS} s (exit $RC)" | tee -a "$OUT"
echo "saved: $OUT"
exit "$RC"
