#!/usr/bin/env bash
# One H200 call for P7 + P15 (issue 9): setup, their GPU tests (kernels at real shapes, PDL, CUDA graphs),
# then fused-vs-unfused microbenchmarks per layer at the Kimi-Linear-48B shape, batch 1/8/64, context 512.
# Look at: $OUT/gpu_tests_p07_p15.log (all passed?) and $OUT/bench_p07_p15.md (µs table).
source tools/gpu_setup.sh
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  tests/passes/kernels/test_attn_res_norm.py tests/passes/kernels/test_mla_decode.py tests/passes/test_gpu_pipeline.py 2>&1 \
  | tee $OUT/gpu_tests_p07_p15.log | tail -25
timeout 200 python3 tools/bench_p07_p15.py $OUT/bench_p07_p15.json 2>&1 | tee $OUT/bench_p07_p15.md | tail -30
