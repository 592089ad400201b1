#!/usr/bin/env bash
# P5 fused KDA decode on the H200, one device call (~3-4 min): the kernel's GPU tests at real shapes
# (Kimi-Linear-48B and K3 heads, batch 1/8/64, fp32 and bf16, PDL), the P1-P5 pipeline GPU test, then
# the per-layer microbenchmark fused vs unfused at the 48B shape (and K3's 96 heads), batch 1/8/64.
# Look at: $OUT/p05_gpu_tests.txt (pass/fail), $OUT/p05_bench.md (µs per layer, kernels per layer).
source tools/gpu_setup.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  tests/passes/kernels/test_kda_decode.py tests/passes/test_gpu_pipeline.py > $OUT/p05_gpu_tests.txt 2>&1
tail -15 $OUT/p05_gpu_tests.txt
{
  timeout 150 python3 tools/bench_kda_decode.py --preset kimi-linear-48b --batch 1 8 64 --out $R/p05_bench_48b.json
  timeout 100 python3 tools/bench_kda_decode.py --preset k3 --batch 1 8 64 --layers 10 --out $R/p05_bench_k3.json
} 2>&1 | grep -v -i warn > $OUT/p05_bench.md
cat $OUT/p05_bench.md
cp $R/p05_bench_*.json $OUT/ 2>/dev/null
