#!/usr/bin/env bash
# Issue 9, the shared expert's gate/up GEMM in kernel A (helper moe8): one device call, < 3 min.
#   1. the gpu-marked tests of the change: kernel A's shared slot at the 48B shape (batch 1 and 8, every design
#      pair, MXFP4, PDL off/on, grouped path), with PDL under a CUDA graph replayed on new routings, and P6 on a
#      Kimi-like bf16 model on CUDA (the GEMM leaves the graph, PDL on, vs the unpassed graph)
#      -> $OUT/gpu_tests.log
#   2. tools/bench_moe8.py: 48B layer bf16, batch 1/2/4/8: today (cuBLAS shared gate/up GEMM + A + B') vs new
#      (A with the shared slot + B'), PDL off/on; op µs from CUDA-graph replays over 4 cycled routings, kernel µs,
#      kernels per call, % of the same-run copy bandwidth, rel err -> $OUT/moe8.md (table), $OUT/moe8.json, bench.log
#   run: bash tools/gpu_moe8.sh      (carry .whl/ as for the other gpu_*.sh)
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  -k "shared_slot or shared_gate_up_in_kernel_a" \
  tests/passes/kernels/test_moe_decode.py tests/passes/test_p06_fused_moe_decode.py 2>&1 | tee $R/gpu_tests.log | tail -12
timeout 120 python3 tools/bench_moe8.py $R 2>&1 | grep -v -i warn | tee $R/bench.log | grep -v '^{' | tail -30
cp $R/*.md $R/*.json $R/*.log $OUT/ 2>/dev/null  # gpu_jobs.sh drops $R (scratch) before packing
