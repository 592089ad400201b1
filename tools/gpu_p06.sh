#!/usr/bin/env bash
# P6 (fused MoE decode) on the H200, one device call (~3-4 min): the gpu-marked P6 kernel tests (Kimi-Linear-48B
# MoE shape, bf16 and MXFP4 experts, SiLU and SiTU, both sides of the crossover, the build-time crossover
# measurement), then the per-layer microbenchmark (tools/bench_p06_moe.py: unfused k3::moe_experts + shared
# expert vs the fused op, batch 1/8/64, µs per layer and GB/s of the expert bytes touched).
# End to end, P6 is a rung of `k3compile bench ladder` (tools/gpu_ladder.sh) once it is in the default pipeline.
#
#   run: bash tools/gpu_p06.sh
# Look at: $OUT/gpu_tests.log (pass/fail), $OUT/p06_moe_bench.md (table + measured crossover), p06_moe_bench.json.
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/passes/kernels/test_moe_decode.py \
  2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 240 python3 tools/bench_p06_moe.py $OUT 2>&1 | grep -v -i warn | tail -25
