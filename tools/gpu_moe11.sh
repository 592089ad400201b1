#!/usr/bin/env bash
# Issue 9, helper moe11: Kimi-Linear-48B MoE at batch 1 and 8 (one device call, ~150 s: sweep <= 100 s, tests <= 60 s;
# PART=sweep or PART=tests runs one half).
#   1. tools/bench_moe11.py: one 48B MoE layer as P6 emits it (shared slot in A, L2 options on, PDL on), batch 1 then 8:
#      today's launches vs kernel A over moe_launch.FULL_ROWS_CANDIDATES, flag_deps on (today's B', then B' with K
#      chunks: FLAG_SPLIT_CANDIDATES), B' over SPLIT_CANDIDATES, then each key's fastest value together; op µs
#      (CUDA-graph replays over 4 cycled routings + shared-weight copies), kernel µs and % of the same-run copy
#      bandwidth, rel err. Prints per batch the fastest arm, the ROWS_TUNED / SPLIT_TUNED entries and P6 options that
#      make it the default, and the `bench ladder --variant` strings for the whole-engine A/B
#      -> $OUT/moe11.md, $OUT/moe11.json (saved after every arm), $OUT/bench.log
#   2. the gpu tests: flag_deps at the 48B shape (bit-identical to off, 26 ops in one CUDA graph), every kernel A
#      candidate vs the reference, P6's up_launch + flag_deps on a Kimi-like model -> $OUT/gpu_tests.log
#   run: bash tools/gpu_moe11.sh      (carry .whl/ as for the other gpu_*.sh; BUDGET=s for the sweep, default 60)
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ "${PART:-all}" != tests ]; then
  timeout 100 python3 tools/bench_moe11.py $OUT ${BUDGET:-60} ${BATCHES:-1,8} 2>&1 | grep -v -i warn \
    | tee $OUT/bench.log | grep -v '^{' | grep -v '^| [0-9]' | tail -40
fi
if [ "${PART:-all}" != sweep ]; then
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_moe_decode.py \
    tests/passes/kernels/test_moe_launch_tables.py tests/passes/test_p06_fused_moe_decode.py \
    -k "flag_deps or 48b_kernel_a or up_launch_and_flag_deps" 2>&1 | tee $OUT/gpu_tests.log | tail -8
fi
