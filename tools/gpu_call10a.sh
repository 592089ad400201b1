#!/usr/bin/env bash
# Session 10, device call 1 (issue 9): the L2-prefetch GPU tests, then whole-engine A/B at the 48B shape.
#   run: TESTS="tests/a.py tests/b.py" VARIANTS="name:PASS.OPT=V,... name2:..." bash tools/gpu_call10a.sh (carry .whl/)
# 1. pytest -m gpu on $TESTS (limit TLIM, default 100 s) -> $OUT/tests.log
# 2. bench ladder at kimi-linear-48b batch $B (default 1), context 512, --quick, no torch.compile / transformers,
#    every rung + one arm per variant (gated against engine-after) -> $OUT/ladder_*.{md,json,png}, ladder.log, traces tar
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
if [ -n "${TESTS:-}" ]; then
  say "gpu tests: $TESTS"
  timeout -s INT ${TLIM:-100} python3 -m pytest -q -m gpu -x -p no:cacheprovider $TESTS > $OUT/tests.log 2>&1
  say "tests: exit $?"; grep -v -i warn $OUT/tests.log | tail -15
fi
VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
say "ladder 48B batch ${B:-1} with ${#VARGS[@]} variants"
timeout ${TL:-220} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B:-1} --context 512 \
  --device cuda --quick --time-budget $(( ${TL:-220} - 30 )) "${VARGS[@]}" --out $OUT/l48 > $OUT/ladder.log 2>&1
say "ladder: exit $?"
(cd $OUT/l48 && tar cf $OUT/traces.tar traces 2>/dev/null); mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|r1[0-9]|v-)|^- (batch|v-|routing|tolerance)" "$md"; done
grep -E "v-.*(FAILED|over the tolerance)|Error|error" $OUT/ladder.log | head -20
say "done"
