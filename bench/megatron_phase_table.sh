#!/usr/bin/env bash
# Per-phase cost of one quickstart-sized AlignOPSD step: the Hugging Face backend (one process) next to the
# Megatron backend at TP=2 (torchrun, 2 ranks; gloo on CPU). The quickstart's batch shape (ALFWorld easy games,
# G=4, 1 task per step, 8 turns, 64-token budgets) with the random tiny Llama (2 heads: TP=2 can split it;
# SmolLM2-135M's 9 heads / 3 KV heads cannot be split in two). Each side runs 2 steps, the first a warm-up left
# out of the numbers (no torch.profiler step). Writes a markdown file: the commands, the commit, the date, the load
# averages before and after, and the table (bench/phase_table.py). Run from anywhere:
#   bash bench/megatron_phase_table.sh [OUT.md]     (default: $TMPDIR/megatron-tp2-phases-<date>.md)
# Environment: PYTHON (interpreter; default the repository's .venv), PHASE_DATA (the generated easy games),
# PHASE_STEPS (default 2), PHASE_WARMUP (default 1), PHASE_STEP_TIMEOUT (seconds one environment reset/step may
# take, default 600: on a loaded machine the quickstart's 60 s fails every episode at reset).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then PY="$ROOT/.venv/bin/python"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DATA="${PHASE_DATA:-$HOME/.cache/alignopsd/alfworld/gen1/easy-pick-w8-n32-v16}"
STEPS="${PHASE_STEPS:-2}"; WARMUP="${PHASE_WARMUP:-1}"
STAMP="$(date -u +%Y-%m-%d)"
OUT="${1:-${TMPDIR:-/tmp}/megatron-tp2-phases-${STAMP}.md}"
[ -d "$DATA" ] || { echo "PHASE_DATA: no such directory: $DATA (generate the easy games first)" >&2; exit 2; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/phase-table.XXXXXX")"
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
SETS=(--set model.name=tiny --set "env.data_dir=$DATA" --set "env.step_timeout_s=${PHASE_STEP_TIMEOUT:-600}")
PROF=(-m alignopsd.engine profile --config configs/quickstart_cpu.yaml --steps "$STEPS" --warmup "$WARMUP" --no-trace)
HF_CMD=("$PY" "${PROF[@]}" "${SETS[@]}" --set "output_dir=$WORK/hf" --json "$WORK/hf.json")
MEG_CMD=("$PY" -m torch.distributed.run --nproc_per_node=2 --master_port="$PORT" "${PROF[@]}" "${SETS[@]}"
         --set policy.backend=megatron --set policy.tensor_parallel_size=2 --set "output_dir=$WORK/meg"
         --json "$WORK/meg.json")
LOAD0="$(uptime)"; T0="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "[phase-table] HF backend: ${HF_CMD[*]}" >&2
"${HF_CMD[@]}" > "$WORK/hf.log" 2>&1 || { tail -30 "$WORK/hf.log" >&2; exit 1; }
echo "[phase-table] Megatron TP=2: ${MEG_CMD[*]}" >&2
"${MEG_CMD[@]}" > "$WORK/meg.log" 2>&1 || { tail -30 "$WORK/meg.log" >&2; exit 1; }
LOAD1="$(uptime)"; T1="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
mkdir -p "$(dirname "$OUT")"
{
  echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown); started $T0, ended $T1;" \
       "niceness $(nice); $(nproc) CPUs"
  echo
  echo "- load before: ${LOAD0#*load average: }"
  echo "- load after: ${LOAD1#*load average: }"
  echo
  echo '```'
  for c in "${HF_CMD[*]}" "${MEG_CMD[*]}"; do  # no machine paths in the record
    echo "$c" | sed "s#$WORK#\$WORK#g; s#$ROOT/##g; s#^$PY #python #; s#$HOME/#~/#g; s#--master_port=$PORT#--master_port=PORT#"
  done
  echo '```'
  echo
  "$PY" -m bench.phase_table "$WORK/hf.json" "$WORK/meg.json" --names "HF,Megatron TP=2"
} > "$OUT"
echo "[phase-table] wrote $OUT (runs in $WORK)" >&2
cat "$OUT"
