#!/usr/bin/env bash
# Issue 9 (mla10): the MLA decode layer's chain (prologue -> W_UK -> split -> merge + W_UV) at the Kimi-Linear-48B
# shape, batch 1/4/8, context 512 (and 4096 within the budget), PDL on, in one CUDA graph over enough layers to miss
# L2: W_UK via cuBLAS (today) vs k3.mla_absorb_q (P15 absorb_q=triton) vs prologue + W_UK in one kernel, W_UV L2
# prefetch (prefetch_w_uv) off/on;
# then the MLA GPU tests. One device call, <= 90 s after setup.
# Look at: $OUT/mla10.md (µs per layer per arm, rel err, test summary), $OUT/mla10.json, $OUT/mla10_tests.txt.
source tools/gpu_setup.sh
{
  echo "# mla10 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log --oneline -1 2>/dev/null)"
  echo
  timeout 50 python3 tools/bench_mla10.py --budget-s 30 --out $OUT/mla10.json 2>&1 | grep -v -i warn
  echo; echo "## MLA GPU tests"; echo '```'
  timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_mla_absorb.py \
    tests/passes/kernels/test_mla_decode.py -k "absorb or prefetch or w_uv or prologue" > $OUT/mla10_tests.txt 2>&1
  grep -E "passed|failed|FAILED|Error" $OUT/mla10_tests.txt | tail -15; echo '```'
} > $OUT/mla10.md
cat $OUT/mla10.md
