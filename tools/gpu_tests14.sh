#!/usr/bin/env bash
# Session 14, last device call (~130 s; what the budget left after four refused starts allows): the GPU tests of the
# kernels written this session, at real shapes, before any ladder runs them:
#   P7 moe_out_norm (mini14: kernel C with the AttnRes norm's tail, k3-mini shapes, CUDA graph replay),
#   P8 upper_tier (bs8k14: k3.gemv's second tier at the 48B o_proj / down shapes, one kernel a call),
#   P15 w_uv_max_tokens (bs8k14: the merge + W_UV kernel at batch 8 / 16).
#   run: bash tools/gpu_tests14.sh   (carry .whl/)
# Back in $OUT: call.log, logs/tests.log
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
run_gpu_tests ${TEST_EACH:-40} \
  "tests/passes/test_p07_moe_out_norm.py::cuda" \
  "tests/passes/test_p08_small_m_gemm.py::upper_tier" \
  "tests/passes/kernels/test_mla_decode.py::w_uv or output_gate"
grep -E "passed|failed|error" $OUT/logs/tests.log | tail -6
say "done"
