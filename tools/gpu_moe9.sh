#!/usr/bin/env bash
# Issue 9, kernel B' (the split down-projection) launch sweep (helper moe9): one device call that fits
# gpu_call9a.sh's 110 s job limit (bench 68 s, tests 38 s).
#   1. tools/bench_moe9.py: 48B MoE layer bf16, batch 1/2/4/8, the op as the engine runs it (A with the shared
#      slot + B'), PDL on: today's B' launch vs each SplitConfig of moe_launch.SPLIT_CANDIDATES (tile, K chunks per
#      slot, prefetch); op µs from CUDA-graph replays over 4 cycled routings, A / B' µs, B' % of the same-run copy
#      bandwidth, rel err; the fastest per batch and its SPLIT_TUNED entry -> $OUT/moe9.md, $OUT/moe9.json, bench.log
#   2. the gpu-marked tests of B' at the 48B shape (K chunks, prefetch, PDL, CUDA-graph replay) and of P6's
#      down_split option on a Kimi-like model -> $OUT/gpu_tests.log
#   run: bash tools/gpu_moe9.sh      (carry .whl/ as for the other gpu_*.sh)
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 68 python3 tools/bench_moe9.py $R 2>&1 | grep -v -i warn | tee $R/bench.log | grep -v '^{' | tail -80
timeout 38 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 -k "split" \
  tests/passes/kernels/test_moe_decode.py tests/passes/test_p06_fused_moe_decode.py 2>&1 | tee $R/gpu_tests.log | tail -12
cp $R/*.md $R/*.json $R/*.log $OUT/ 2>/dev/null  # gpu_jobs.sh drops $R (scratch) before packing
