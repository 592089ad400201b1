#!/usr/bin/env bash
# Issue 9 (kda8): P5's KDA decode kernel with the prefetch before gdc_wait, P8's GEMV with PDL. One device
# call, < 4 minutes (each part has its own timeout; partial output is kept).
# 1. GPU tests (70 s): the KDA kernel at real shapes (every launch choice the bench sweeps, prefetch on/off,
#    the in_proj GEMV -> KDA -> o_proj GEMV chain with PDL in a CUDA graph), the fold / verify-inputs
#    bit-identity tests against P5 (the kernel was restructured: they must stay bit-identical), P8's tests.
# 2. tools/bench_kda8.py (120 s): 48B shape, batch 1/8/64, state pool of 128 slots: a cuBLAS or Triton-GEMV
#    (PDL) in_proj before the KDA kernel, PDL off / on wait-first / on prefetch; then the V split x block_v x
#    warps sweep (quick) of the kernel alone.
# 3. tools/bench_gemv.py --pdl-chain (45 s): o_proj and in_proj GEMVs back to back, cuBLAS vs Triton PDL off/on.
# Look at: $OUT/kda8.md (test summary + all tables), $OUT/kda8_tests.txt, $OUT/kda8_bench.json, $OUT/kda8_gemv.json.
source tools/gpu_setup.sh
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/passes/kernels/test_kda_decode.py tests/runtime/spec/test_fold_gpu.py \
  tests/passes/kernels/test_kda_verify_inputs.py tests/passes/test_p08_small_m_gemm.py > $OUT/kda8_tests.txt 2>&1
{
  echo "# kda8 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log --oneline -1 2>/dev/null)"
  echo; echo "## GPU tests"; echo '```'; grep -E "passed|failed|FAILED|Error" $OUT/kda8_tests.txt | tail -15; echo '```'
  echo; echo "## KDA kernel behind the in_proj (tools/bench_kda8.py)"
  timeout 120 python3 tools/bench_kda8.py --batch 1 8 64 --replays 20 --quick-sweep --out $OUT/kda8_bench.json 2>&1 \
    | grep -v -i warn
  echo; echo "## GEMV chains, PDL off/on (tools/bench_gemv.py --pdl-chain)"; echo '```'
  timeout 45 python3 tools/bench_gemv.py --pdl-chain --json $OUT/kda8_gemv.json 2>&1 | grep -v -i warn
  echo '```'
} > $OUT/kda8.md
cat $OUT/kda8.md
