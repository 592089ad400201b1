#!/usr/bin/env bash
# Issue 9, MoE rung (helper moe3): the reworked fused MoE decode kernels on the H200, one device call (< 3 min).
#   1. gpu-marked tests of P4 routing and P6 fused MoE (kernels at the Kimi-Linear-48B and k3-mini-6b shapes,
#      bf16 and MXFP4, PDL, the passes on CUDA) -> $OUT/r/gpu_tests.log
#   2. tools/bench_moe_kernels.py: old vs new kernels per kernel, µs, GB/s and % of the same-run copy
#      bandwidth, batch 1/8/64, bf16 and MXFP4, both shapes, then a tile sweep at the 48B shape
#      -> $OUT/r/moe_kernels.md (table), $OUT/r/moe_kernels.json (raw + sweep)
#   run: bash tools/gpu_moe3.sh
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 -x \
  tests/passes/kernels/test_moe_decode.py tests/passes/kernels/test_routing.py \
  tests/passes/test_p04_fused_routing.py tests/passes/test_p06_fused_moe_decode.py 2>&1 | tee $R/gpu_tests.log | tail -12
timeout 140 python3 tools/bench_moe_kernels.py $R 2>&1 | grep -v -i warn | tee $R/bench.log | grep -v '^{' | tail -70
