#!/usr/bin/env bash
# Issue 15's cache benchmark on this CPU (no GPU needed): tune the `valued` eviction's weight on
# seed 0, then report every policy on seeds 1 and 2 at three budgets (generous -> tight).
# Usage: tools/cache_pressure_report.sh [OUT_DIR] [ROOTS]   (defaults: traces/cache_pressure/report, 8)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-traces/cache_pressure/report}
ROOTS=${2:-8}
export OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
# tuning (seed 0 only): value_weight 0.5 / 1 / 4 at the tight budget
$PY -m k3compile.cli bench cache-pressure --traces agent,tot --seeds 0 --roots "$ROOTS" --budgets-kib 1024 \
    --policies "end;valued:weight=0.5;valued:weight=1;valued:weight=4" --out "$OUT/tune_seed0"
# report (seeds never used for tuning)
$PY -m k3compile.cli bench cache-pressure --traces agent,tot --seeds 1,2 --roots "$ROOTS" \
    --budgets-kib 65536,1536,1024 --policies none,end,every_chunk,sparse,valued --out "$OUT"
cat "$OUT/cache_pressure.md"
