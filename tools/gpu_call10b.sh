#!/usr/bin/env bash
# Session 10, device call 4 (issue 9): the 48B ladder at batch 1 and 8 with the new defaults (+ variants), then the
# k3-mini-6b latent MoE launch sweep (tools/gpu_mini10.sh).
#   run: VARIANTS="name:PASS.OPT=V,..." B=1,8 TL=260 bash tools/gpu_call10b.sh   (carry .whl/)
# Back in $OUT: ladder_*.{md,json,png}, ladder.log, traces.tar (bs1 traces), mini10.tar (mini10.md/json, logs)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
say "ladder 48B batch ${B:-1,8} with ${#VARGS[@]} variants"
timeout ${TL:-260} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B:-1,8} --context 512 \
  --device cuda --quick --time-budget $(( ${TL:-260} - 30 )) "${VARGS[@]}" --out $OUT/l48 > $OUT/ladder.log 2>&1
say "ladder: exit $?"
(cd $OUT/l48 && tar cf $OUT/traces.tar traces 2>/dev/null); mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|r0[4-6]|r1[0-9]|v-)|^- (batch|v-|routing|tolerance)" "$md"; done
mkdir -p $OUT/mini10
say "mini10 sweep"
OUT=$OUT/mini10 R=$OUT/mini10/r timeout -s INT ${LIMIT_MINI:-130} bash tools/gpu_mini10.sh > $OUT/mini10/console.log 2>&1
say "mini10: exit $?"; rm -rf $OUT/mini10/r
(cd $OUT && tar cf mini10.tar mini10 && rm -rf mini10)
tar xOf $OUT/mini10.tar mini10/mini10.md 2>/dev/null | grep -A40 -i "fastest arm" | head -60
say "done"
