#!/usr/bin/env bash
# One H200 call (<= 9 minutes): `k3compile bench ladder` at the Kimi-Linear-48B-A3B shape (random bf16 weights,
# 27 layers, 256 experts; ~98 GB on the GPU) and at k3-mini-6b, batch 1/8/64, context 512; then `k3compile
# report` on the last rung's bs1 profiler trace of each. Every rung is the decode step after the first k passes
# of the default pipeline (whatever passes/ registers when this runs), timed interleaved with eager in one process.
#
#   run: bash tools/gpu_ladder.sh                 (COMPILE=1 adds the torch.compile(reduce-overhead) anchor:
#                                                  ~70+ s of compile per model; then lower STEPS or drop a model)
#
# Back in $OUT (the device returns at most 8 files): ladder_<model>_bf16.{json,md,png} for both models,
# ladder_traces.tar (bs1 traces of the last rung and engine-before, each with its `k3compile report` text),
# ladder.log.
# Budgets: P8 GPU tests 80 s, 48B 255 s, 6B 125 s (`--time-budget` skips arms that would start later; JSON/md are rewritten after
# every batch size, so a cut run keeps what it measured). 40 steps x 5 reps is below BENCHMARKS.md's 200
# steps: the markdown says "smoke run"; the per-rung ratios are what this call is for.
source tools/gpu_setup.sh
set -o pipefail
STEPS=${STEPS:-40}; REPS=${REPS:-5}; WARMUP=${WARMUP:-20}
EXTRA=""; [ "${COMPILE:-0}" = "1" ] && EXTRA="--compile"
LOG=$OUT/ladder.log
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG" 2>&1
python3 -c "import k3compile.passes.registry as r; print('pipeline:', ', '.join(r.registered_passes()))" 2>&1 | tee -a "$LOG"

ladder() {  # model, time budget (s), hard timeout (s)
  timeout "$3" k3compile bench ladder --model "$1" --dtype bf16 --batch 1,8,64 --context 512 --device cuda \
    --steps "$STEPS" --reps "$REPS" --warmup "$WARMUP" --time-budget "$2" $EXTRA --out "$R/$1" 2>&1 \
    | grep -v -i warn >> "$LOG"
  echo "ladder $1: exit $?" | tee -a "$LOG"
  cp "$R/$1"/ladder_*.json "$R/$1"/ladder_*.md "$R/$1"/ladder_*.png "$OUT/" 2>/dev/null
  for t in "$R/$1"/traces/*_bs1.json.gz; do
    [ -e "$t" ] || continue
    k3compile report "$t" --top 25 > "${t%.json.gz}.report.txt" 2>&1
  done
}
# every kernel's GPU tests at real shapes (P5, P6, P7, P8, P15) before the ladder trusts them
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/passes/test_p08_small_m_gemm.py \
  tests/passes/kernels/test_kda_decode.py tests/passes/kernels/test_moe_decode.py tests/passes/kernels/test_mla_decode.py \
  tests/passes/kernels/test_attn_res_norm.py >> "$LOG" 2>&1
echo "kernel gpu tests (P5, P6, P7, P8, P15): exit $?" | tee -a "$LOG"
grep -E "^FAILED|passed|failed" "$LOG" | tail -20
ladder kimi-linear-48b 245 270
ladder k3-mini-6b 105 130
(cd "$R" && tar cf "$OUT/ladder_traces.tar" */traces/*_bs1.* 2>>"$LOG")
rm -rf "$R"  # under $OUT: its copies would count against the 8 files that come back
grep -h -A14 "^| arm |" "$OUT"/ladder_*.md
ls -la "$OUT"
