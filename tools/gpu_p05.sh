#!/usr/bin/env bash
# P5 fused KDA decode on the H200, one device call (about 7-9 min; run with timeout_s 600): the kernel's GPU
# tests at real shapes (Kimi-Linear-48B: 32 heads, K3: 96 heads; batch 1/8/64; fp32 and bf16; low-rank
# GEMVs absorbed or not; PDL), the P1-P5 pipeline on CUDA (k3-tiny, verify on), then the per-layer
# microbenchmark fused vs unfused (CUDA graphs of 20 / 10 KDA layers, L2 flushed) at batch 1/8/64.
# Look at: $OUT/p05_gpu_tests.txt (pass/fail, last lines), $OUT/p05_bench.md (µs per layer and kernels
# per layer, unfused vs fused vs fused+PDL), $OUT/p05_bench_*.json (the same rows).
source tools/gpu_setup.sh
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  tests/passes/kernels/test_kda_decode.py tests/passes/test_gpu_pipeline.py > $OUT/p05_gpu_tests.txt 2>&1
tail -15 $OUT/p05_gpu_tests.txt
{
  timeout 150 python3 tools/bench_kda_decode.py --preset kimi-linear-48b --batch 1 8 64 --out $R/p05_bench_48b.json
  timeout 100 python3 tools/bench_kda_decode.py --preset k3 --batch 1 8 64 --layers 10 --out $R/p05_bench_k3.json
} 2>&1 | grep -v -i warn > $OUT/p05_bench.md
cat $OUT/p05_bench.md
cp $R/p05_bench_*.json $OUT/ 2>/dev/null
