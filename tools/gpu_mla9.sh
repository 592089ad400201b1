#!/usr/bin/env bash
# Issue 9 (mla9): MLA decode attention + W_UV, whole-row merge (before) vs column-block merge (LAUNCH_TABLE) and
# a (num_splits, merge_cols) sweep at the Kimi-Linear-48B shape, batch 1/4/8, context 512/4096, PDL on, CUDA-graph
# replays over enough layers to miss L2; then the MLA GPU tests. One device call, about 2 minutes after setup.
# Look at: $OUT/mla9.md (bench table, fastest per shape, test summary), $OUT/mla9.json, $OUT/mla9_tests.txt.
source tools/gpu_setup.sh
{
  echo "# mla9 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log --oneline -1 2>/dev/null)"
  echo
  timeout 70 python3 tools/bench_mla9.py --budget-s 45 --out $OUT/mla9.json 2>&1 | grep -v -i warn
  echo; echo "## MLA GPU tests"; echo '```'
  timeout 45 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/passes/kernels/test_mla_decode.py tests/passes/test_p15_mla_decode.py > $OUT/mla9_tests.txt 2>&1
  grep -E "passed|failed|FAILED|Error" $OUT/mla9_tests.txt | tail -15; echo '```'
} > $OUT/mla9.md
cat $OUT/mla9.md
