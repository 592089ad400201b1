#!/usr/bin/env bash
# Issue 9, norm + router in one kernel (route8, pass p07_norm_route) on the H200, one call (~2-3 min): the
# gpu-marked tests of the fused kernel (48B / k3-mini-6b shapes, batch 1 and 8, two launches, the pair above
# max_tokens, a CUDA-graph replay) and P7's / P4's kernel tests (shared jit helpers changed), then
# tools/bench_route8.py (P7 kernel + absorbed router vs the fused kernel, PDL off/on, BLOCK_E and warps sweeps).
#   run: bash tools/gpu_route8.sh          (carry .whl/, like every call: tools/gpu_setup.sh installs fla)
# Look at: $OUT/route8_tests.log (pass/fail), $OUT/route8.md (table: pair/fused+PDL per shape and batch; the
# sweeps set norm_route.default_blocks), route8.json.
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/passes/test_p07_norm_route.py \
  tests/passes/kernels/test_attn_res_norm.py tests/passes/kernels/test_routing.py \
  2>&1 | tee $OUT/route8_tests.log | tail -15
timeout 170 python3 tools/bench_route8.py $OUT 2>&1 | grep -v -i warn | tail -25
