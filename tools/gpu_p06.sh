#!/usr/bin/env bash
# P6 (fused MoE decode) on the H200, one device call: the gpu-marked P6 tests (48B shape, bf16 and MXFP4,
# both sides of the crossover), the per-layer microbenchmark (tools/bench_p06_moe.py -> $OUT/p06_moe_bench.md),
# then, if time is left, the 48B engine at batch 1/8/64 with and without P6.
# Look at: $OUT/gpu_tests.log (pass/fail), $OUT/p06_moe_bench.md (µs per layer, GB/s, crossover),
# $OUT/engine_p06.md vs $OUT/engine_no_p06.md (step ms).
source tools/gpu_setup.sh
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_moe_decode.py \
  2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 150 python3 tools/bench_p06_moe.py $OUT 2>&1 | grep -v -i warn | tail -20
for arm in p06 no_p06; do
  flags=""; [ $arm = no_p06 ] && flags="--disable-pass p06"
  timeout 140 k3compile bench decode --model kimi-linear-48b --dtype bf16 --batch 1,8,64 --context 512 --steps 20 \
    --reps 2 --warmup 10 --arms engine --time-budget 130 $flags --out $R/engine_$arm 2>&1 | grep -v -i warn | tail -6
  cp $R/engine_$arm/*.md $OUT/engine_$arm.md 2>/dev/null
done
