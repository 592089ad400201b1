#!/usr/bin/env bash
# Issue 9, route11: P7's norm_route launch options (tail, target_programs) on the H200, ~60-90 s (Triton compiles
# most of it; the tests' compiles are reused by the bench through Triton's cache).
#   run: bash tools/gpu_route11.sh        (carry .whl/, like every call: tools/gpu_setup.sh installs fla)
#   TESTS=0 skips step 1.
# 1. pytest -m gpu tests/passes/test_p07_norm_route.py (every tail and target_programs=32 vs the default launch at
#    48B / k3-mini-6b, batch 1 and 8, random and exactly tied logits; CUDA-graph replays) -> $OUT/route11_tests.log
# 2. tools/bench_route11.py: µs per norm_route call (PDL chain in a CUDA graph, W from HBM), arms rounds (today) /
#    lean / bitonic, each also with target_programs=32, at both shapes, batch 1 and 8 -> $OUT/route11.{md,json}
# Look at: the tests' pass line, then route11.md's ratio columns (rounds / arm, one run; > 1 is faster).
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ "${TESTS:-1}" != 0 ]; then
  timeout -s INT ${TLIM:-50} python3 -m pytest -q -m gpu -x -p no:cacheprovider -rs tests/passes/test_p07_norm_route.py \
    > $OUT/route11_tests.log 2>&1
  say "tests: exit $?"; grep -v -i warn $OUT/route11_tests.log | tail -6
fi
timeout ${BLIM:-70} python3 tools/bench_route11.py $OUT > $OUT/route11_bench.log 2>&1
say "bench: exit $?"; grep -v -i warn $OUT/route11_bench.log | grep -v '^{' | tail -12
