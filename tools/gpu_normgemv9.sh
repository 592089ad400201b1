#!/usr/bin/env bash
# Issue 9 (normgemv9): P7's norm fused into P8's GEMV prologue (k3.norm_gemv, pass p08_small_m_norm_gemv).
# Fits gpu_call9a.sh's 110 s job limit (JOBS=normgemv9): tests 40 s, bench 60 s (partial output is kept).
# 1. GPU tests (40 s): the kernel at the 48B in_proj shape, M 1/4/8, P8's candidates (4 warps), PDL, in a CUDA graph.
# 2. tools/bench_norm_gemv.py (60 s): µs of the (norm, GEMV) pair vs the fused call at the 48B in_proj and
#    gate/up shapes, same configuration, PDL chain in a CUDA graph.
# Look at: $OUT/normgemv9.md (test summary + the µs table), $OUT/normgemv9_tests.txt, $OUT/normgemv9_bench.json.
# The whole-engine A/B: bench ladder --variant nonormgemv:p08_small_m_norm_gemv.enabled=false
source tools/gpu_setup.sh
timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/passes/test_p08_small_m_norm_gemv.py \
  > $OUT/normgemv9_tests.txt 2>&1; echo "(exit $?)" >> $OUT/normgemv9_tests.txt
{
  echo "# normgemv9 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log --oneline -1 2>/dev/null)"
  echo; echo "## GPU tests (tests/passes/test_p08_small_m_norm_gemv.py -m gpu)"
  echo '```'; grep -E "^\(exit|passed|failed|^FAILED|^ERROR|^E  " $OUT/normgemv9_tests.txt | tail -24; echo '```'
  echo; echo "## (norm, GEMV) pair vs k3.norm_gemv, PDL chain in a CUDA graph (tools/bench_norm_gemv.py)"
  echo '```'
  timeout 60 python3 tools/bench_norm_gemv.py --json $OUT/normgemv9_bench.json 2>&1 | grep -v -i warn
  echo '```'
} > $OUT/normgemv9.md
cat $OUT/normgemv9.md
