#!/usr/bin/env bash
# Issue 9 (gemv9): P8 times its GEMV candidates the way the engine launches them (timing=pdl_chain) and sweeps
# the rows design's warps. One device call, < 2 minutes (each part has its own timeout; partial output is kept).
# 1. GPU tests (45 s): P8 / k3.gemv at real shapes, every warps candidate with PDL in a CUDA graph, 'auto' with
#    both timings.
# 2. tools/bench_gemv.py --p8 (60 s): P8's own _measure + _decide at the 48B in_proj, o_proj, MLA input GEMM and
#    lm_head, timing pdl_chain vs alone: the choice each makes, per bucket cuBLAS / best / chosen µs, and the
#    seconds the measuring took (the build-time cost; P8 took 14 s for a whole 48B build before).
# Look at: $OUT/gemv9.md (test summary + the P8 table), $OUT/gemv9_tests.txt, $OUT/gemv9_p8.json.
source tools/gpu_setup.sh
NEW="warps_candidates or auto_choice"  # this change's GPU tests first: a timeout then cuts the older ones
for sel in "$NEW:25" "not ($NEW):20"; do
  echo "### -k '${sel%:*}' (${sel##*:} s)"
  timeout ${sel##*:} python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -k "${sel%:*}" tests/passes/test_p08_small_m_gemm.py
  echo "(exit $?)"
done > $OUT/gemv9_tests.txt 2>&1
{
  echo "# gemv9 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log --oneline -1 2>/dev/null)"
  echo; echo "## GPU tests (tests/passes/test_p08_small_m_gemm.py -m gpu)"
  echo '```'; grep -E "^###|^\(exit|passed|failed|^FAILED|^ERROR|^E  " $OUT/gemv9_tests.txt | tail -24; echo '```'
  echo; echo "## P8's measurement and choice at the 48B shapes, timing pdl_chain vs alone (tools/bench_gemv.py --p8)"
  echo '```'
  timeout 60 python3 tools/bench_gemv.py --p8 --json $OUT/gemv9_p8.json 2>&1 | grep -v -i warn
  echo '```'
} > $OUT/gemv9.md
cat $OUT/gemv9.md
