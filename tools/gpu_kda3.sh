#!/usr/bin/env bash
# Issue 9 (kda3): split-V fused KDA decode + PDL on by default. One device call, < 3 minutes.
# 1. GPU tests of the kernels touched: KDA (real shapes, every V split, CUDA-graph replays), attn_res_norm,
#    MLA decode (prologue + attention, now launched with PDL by default in P15).
# 2. KDA microbench: old schedule (V split 1) vs the split kernel, 48B and k3-mini-6b shapes, batch 1/8/64,
#    PDL off/on, with each arm's relative error vs the reference.
# 3. PDL on/off over a short chain (attn_res_norm -> GEMM -> KDA -> GEMM, and without the GEMMs).
# Look at: $OUT/kda3_tests.txt (pass/fail), $OUT/kda3_bench.md (tables), $OUT/kda3_*.json (rows).
source tools/gpu_setup.sh
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/passes/kernels/test_kda_decode.py tests/passes/kernels/test_attn_res_norm.py \
  tests/passes/kernels/test_mla_decode.py > $OUT/kda3_tests.txt 2>&1
tail -5 $OUT/kda3_tests.txt
{
  timeout 40 python3 tools/bench_kda_decode.py --preset kimi-linear-48b --batch 1 8 64 --no-unfused --replays 30 \
    --out $OUT/kda3_bench_48b.json
  timeout 30 python3 tools/bench_kda_decode.py --preset k3-mini-6b --batch 1 8 64 --no-unfused --replays 30 \
    --layers 21 --out $OUT/kda3_bench_6b.json
  timeout 25 python3 tools/bench_pdl_chain.py --batch 1 8 --replays 30 --out $OUT/kda3_pdl_chain.json
} 2>&1 | grep -v -i warn > $OUT/kda3_bench.md
cat $OUT/kda3_bench.md
