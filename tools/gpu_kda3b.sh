#!/usr/bin/env bash
# Issue 9 (kda3, round b): attn_res_norm one-pass bank tile + P7's zeros_like fold. One device call, < 2 minutes.
# 1. GPU tests of attn_res_norm (both kernels at K3 / k3-mini-6b / Kimi-Linear shapes, delta None, PDL,
#    fp32 copy, CUDA graphs).
# 2. Microbench: streaming kernel (old) vs one-pass tile (new) at k3-mini-6b (D 2048, bank 1/4/8, with and
#    without delta), Kimi-Linear-48B (D 2304, empty bank: a control) and K3 (D 7168, bank 3), batch 1/8/64;
#    warp sweep of the tile; relative error of both vs the CPU reference.
# Look at: $OUT/kda3b_tests.txt (pass/fail), $OUT/kda3b_bench.md (table), $OUT/kda3b_attn_res_norm.json (rows).
source tools/gpu_setup.sh
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/passes/kernels/test_attn_res_norm.py > $OUT/kda3b_tests.txt 2>&1
tail -5 $OUT/kda3b_tests.txt
timeout 55 python3 tools/bench_attn_res_norm.py --batch 1 8 64 --out $OUT/kda3b_attn_res_norm.json 2>&1 \
  | grep -v -i warn > $OUT/kda3b_bench.md
cat $OUT/kda3b_bench.md
