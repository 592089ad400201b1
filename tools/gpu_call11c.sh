#!/usr/bin/env bash
# Session 11, device call 3 (issue 9): the final defaults (kernel A at 48B batch 1 with 8 warps, ROWS_TUNED).
#   bench ladder, Kimi-Linear-48B shape, batch 1 and 8 (--quick), whole-engine variants $VARIANTS (e.g. the previous
#   kernel A launch, route11's routing tails), then `k3compile report` of engine-after's batch-1 trace (top kernels)
#   run: VARIANTS="..." TL=300 bash tools/gpu_call11c.sh   (carry .whl/)
# Back in $OUT: ladder_*.{md,json,png}, ladder.log, report48.json, report48.txt
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
timeout $(( ${TL:-300} + 20 )) k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B48:-1,8} \
  --context 512 --device cuda --quick --time-budget ${TL:-300} "${VARGS[@]}" --out $OUT/l48 > $OUT/ladder.log 2>&1
say "ladder: exit $?"
TR=$(ls $OUT/l48/traces/*r1[0-9]*bs1.json.gz 2>/dev/null | tail -1)
[ -n "$TR" ] && k3compile report "$TR" --top 30 --json $OUT/report48.json > $OUT/report48.txt 2>&1
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|eager|r04|r1[45]|v-)|^- (batch|routing|tolerance)" "$md" | cut -c1-200; done
grep -A22 "^Top GPU kernels" $OUT/report48.txt | cut -c1-130
say "done"
