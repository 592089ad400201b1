#!/usr/bin/env bash
# Session 12, device call 1 (issue 9): PDL early release (session 13: TEST_SPECS chooses the tests).
#   1. GPU tests: the same-bits / reference tests of the early-release options (P8's GEMV, P5's KDA kernel in a PDL
#      chain, P6's kernel A) at the 48B shapes
#   2. bench ladder, Kimi-Linear-48B shape, batch ${B48:-1}, whole-engine variants $VARIANTS
#   3. `k3compile report` of engine-after's batch-1 trace and of variant $REPORT_V's (if set)
#   run: VARIANTS="eg:p08_small_m_gemm.early_release=true ..." REPORT_V=eall TL=300 bash tools/gpu_call12a.sh
# TESTS=first|last|0: the GPU tests before the ladder, after it, or not at all.
# Back in $OUT: ladder_*.{md,json,png}, call.log, report48.{txt,json}, report48_v.json, logs.tar (tests, ladder log,
# report48_v.txt)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
# TEST_SPECS="FILE::K_EXPR ...": other GPU tests than the early-release ones (default below)
TEST_SPECS=${TEST_SPECS:-"tests/passes/kernels/test_kda_decode.py::pdl_chain tests/passes/kernels/test_moe_decode.py::early_release tests/passes/test_p06_fused_moe_decode.py::up_launch tests/passes/test_p08_small_m_gemm.py::early_release"}
run_tests() { # one file at a time (a slow file does not hide the others' results)
  run_gpu_tests ${TEST_EACH:-100} $TEST_SPECS
}
mkdir -p $OUT/logs
[ "${TESTS:-last}" = first ] && run_tests
VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
timeout $(( ${TL:-300} + 20 )) k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B48:-1} \
  --context 512 --device cuda --quick --time-budget ${TL:-300} --keep-traces all "${VARGS[@]}" --out $OUT/l48 \
  > $OUT/logs/ladder.log 2>&1
say "ladder: exit $?"
TR=$(ls $OUT/l48/traces/*_r[0-9][0-9]-*bs1.json.gz 2>/dev/null | sort | tail -1)  # the last rung: engine-after
[ -n "$TR" ] && k3compile report "$TR" --top 25 --json $OUT/report48.json > $OUT/report48.txt 2>&1
if [ -n "${REPORT_V:-}" ]; then
  TV=$(ls $OUT/l48/traces/*v-${REPORT_V}_bs1.json.gz 2>/dev/null | tail -1)
  [ -n "$TV" ] && k3compile report "$TV" --top 25 --json $OUT/report48_v.json > $OUT/report48_v.txt 2>&1
fi
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
[ -f $OUT/report48_v.txt ] && mv $OUT/report48_v.txt $OUT/logs/
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|eager|r04|r1[45]|v-)|^- (batch|routing|tolerance)" "$md" | cut -c1-200; done
for r in $OUT/report48.txt $OUT/logs/report48_v.txt; do [ -f $r ] && { echo "== $r"; grep -A12 "^Top GPU kernels" $r | cut -c1-120; }; done
[ "${TESTS:-last}" = last ] && run_tests
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"
