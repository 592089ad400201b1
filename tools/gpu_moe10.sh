#!/usr/bin/env bash
# Issue 9, the MoE op's L2 prefetch options (helper moepf10): one device call, <= 90 s (bench 55 s, tests 32 s).
#   1. tools/bench_moe10.py: 48B MoE layer bf16, batch 1/8/2/4, the router kernel then the op (kernel A with the shared
#      slot + B'), PDL on, CUDA-graph replays over 4 cycled argument sets: arms off / A order / A prefetch / B' prefetch
#      / both; chain and op µs (median of 3 interleaved rounds), change vs off, bit-identity vs off, rel err
#      -> $OUT/moe10.md, $OUT/moe10.json, $OUT/bench.log
#   2. the gpu-marked tests of the options (48B shape batch 1 and 8: same bits on/off, reference; P6 on a Kimi-like
#      model) -> $OUT/gpu_tests.log
#   run: bash tools/gpu_moe10.sh      (carry .whl/ as for the other gpu_*.sh)
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 55 python3 tools/bench_moe10.py $R 2>&1 | grep -v -i warn | tee $R/bench.log | grep -v '^{' | tail -40
timeout 32 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 -k "l2_prefetch" \
  tests/passes/kernels/test_moe_decode.py tests/passes/test_p06_fused_moe_decode.py 2>&1 | tee $R/gpu_tests.log | tail -12
cp $R/*.md $R/*.json $R/*.log $OUT/ 2>/dev/null  # gpu_jobs.sh drops $R (scratch) before packing
