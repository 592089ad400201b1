#!/usr/bin/env bash
# Issue 9, MoE down-projection designs (helper moe7): one device call, < 4 min.
#   1. the gpu-marked MoE kernel tests that the change touches (48B / k3-mini shapes; the new "split" design: reference, bit-identical
#      repeats, counters zero, CUDA-graph replay) and the KDA decode ones (the arrival counters moved to
#      kernels/arrivals.py) -> $OUT/r/gpu_tests.log
#   2. tools/bench_moe7.py: per down design (rows / tiles / split) x PDL off/on, 48B and k3-mini, bf16 and MXFP4,
#      batch 1/2/4/8: op µs, kernel µs, GB/s, % of the same-run copy bandwidth; split BLOCK_N sweep
#      -> $OUT/r/moe7.md (tables), $OUT/r/moe7.json (raw), $OUT/r/bench.log
#   run: bash tools/gpu_moe7.sh
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 -k "split or latent_tail or pdl" \
  tests/passes/kernels/test_moe_decode.py tests/passes/kernels/test_kda_decode.py 2>&1 | tee $R/gpu_tests.log | tail -12
timeout 120 python3 tools/bench_moe7.py $R 2>&1 | grep -v -i warn | tee $R/bench.log | grep -v '^{' | tail -90
cp $R/*.md $R/*.json $R/*.log $OUT/ 2>/dev/null  # gpu_jobs.sh drops $R (scratch) before packing
