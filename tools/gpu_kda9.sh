#!/usr/bin/env bash
# Issue 9 (kda9): P5's KDA decode kernel under the launch layouts of model_def/ops/kda_launch.py (only "s8":
# "wide", V split 2 / 64 columns / 8 warps, was dropped after session 9's run). One device call, <= 110 s
# (gpu_call9a.sh's default job limit; each part has its own timeout; partial output is kept).
#   alone: bash tools/gpu_kda9.sh      in session 9's call: JOBS="... kda9 ..." bash tools/gpu_call9a.sh
# 1. tools/bench_kda9.py (62 s): 48B shape, batch 1 and 8, state pool of 128 slots, CUDA-graph replays: each
#    layout x PDL off / wait first / prefetch, behind a cuBLAS and a Triton-GEMV (P8, PDL) in_proj; then a
#    small V split x block_v x warps sweep of the kernel alone.
# 2. GPU tests (40 s, -v so a timeout still shows each finished test): the fold and P16's verify inputs
#    bit-identical to P5 under each layout first, then the kernel's launch tests at real shapes.
# Look at: $OUT/kda9.md (all tables, the fastest chain per predecessor, the test summary), $OUT/kda9_bench.json,
# $OUT/kda9_tests.txt. Set the winner with --pass-opt p05_fused_kda_decode.launch=NAME (and the same NAME for
# p16_kda_verify_inputs.launch) and p05_fused_kda_decode.prefetch=true|false.
source tools/gpu_setup.sh
{
  echo "# kda9 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log --oneline -1 2>/dev/null)"
  echo; echo "## KDA kernel per launch layout behind the in_proj (tools/bench_kda9.py)"
  timeout 62 python3 tools/bench_kda9.py --batch 1 8 --replays 20 --out $OUT/kda9_bench.json 2>&1 | grep -v -i warn
} > $OUT/kda9.md
timeout 40 python3 -m pytest -v -m gpu -p no:cacheprovider tests/runtime/spec/test_fold_gpu.py \
  tests/passes/test_p16_gpu.py tests/passes/kernels/test_kda_decode.py -k "fold or p16 or layout or launch or split" \
  > $OUT/kda9_tests.txt 2>&1
{
  echo; echo "## GPU tests (fold, P16, P5 kernel launches)"; echo '```'
  echo "PASSED $(grep -c ' PASSED' $OUT/kda9_tests.txt), FAILED $(grep -c ' FAILED' $OUT/kda9_tests.txt)"
  grep -E " FAILED|Error" $OUT/kda9_tests.txt | head -10; tail -1 $OUT/kda9_tests.txt; echo '```'
} >> $OUT/kda9.md
cat $OUT/kda9.md
