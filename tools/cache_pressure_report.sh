#!/usr/bin/env bash
# Issue 15's cache benchmark on this CPU (no GPU needed): tune on seed 0, then report every policy
# on seeds 1-3 at three budgets (generous -> tight). The engine runs with the stand-in forward
# (bench/cache_replay.py: scheduler, cache and pools as in serving, no model forward).
# Usage: tools/cache_pressure_report.sh [OUT_DIR] [ROOTS]   (defaults: traces/cache_pressure, 60)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-traces/cache_pressure}
ROOTS=${2:-60}
export OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
# tuning (seed 0 only): per-path cap and the value weight at the two tight budgets
$PY -m k3compile.cli bench cache-pressure --seeds 0 --roots "$ROOTS" --budgets-kib 2048,1024 \
    --policies "none;end;every_chunk;sparse;valued;sparse:per_path=1;valued:per_path=1;valued:weight=4" \
    --out "$OUT/tune_seed0"
# report (seeds never used for tuning)
$PY -m k3compile.cli bench cache-pressure --seeds 1,2,3 --roots "$ROOTS" --budgets-kib 65536,2048,1024 \
    --out "$OUT/report"
cat "$OUT/report/cache_pressure.md"
