#!/usr/bin/env bash
# Issue 9, P4 absorbing the router GEMM (route7) on the H200, one call (~1-2 min): the gpu-marked routing tests
# (the absorbed kernel at the 48B / k3-mini-6b shapes, two launches, CUDA-graph replays, the switch at the
# threshold), then tools/bench_route7.py (cuBLAS mm + routing kernel vs the absorbed kernel, batch 1..64, and a
# BLOCK_E sweep).
#   run: bash tools/gpu_route7.sh
# Look at: $OUT/route7_tests.log (pass/fail), $OUT/route7.md (table: where absorbed stops winning sets
# p04_fused_routing.absorb_router_max_tokens; the sweep sets routing.default_linear_route_blocks), route7.json.
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_routing.py \
  2>&1 | tee $OUT/route7_tests.log | tail -15
timeout 150 python3 tools/bench_route7.py $OUT 2>&1 | grep -v -i warn | tail -25
