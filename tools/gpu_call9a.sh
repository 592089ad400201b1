#!/usr/bin/env bash
# Session 9, device call 1 (issue 9): the helpers' kernel benches + GPU tests, then whole-engine A/B at the 48B shape.
#   run: JOBS="moe9 mla9 kda9 gemv9" VARIANTS="name:PASS.OPT=V,... name2:..." bash tools/gpu_call9a.sh  (carry .whl/)
# 1. (second) each job's tools/gpu_<job>.sh with its own $OUT/<job>/ and a time limit (LIMIT_<job>, default 110 s);
# 2. (first: the whole-engine A/B matters most) `bench ladder` at kimi-linear-48b batch $B (default 1), context 512, --quick, no torch.compile / transformers,
#    every rung + one arm per variant (the last rung's pipeline with other pass options, gated against it).
# Back in $OUT: <job>/ (each job's md/json/logs), ladder_*.{md,json} and ladder9a.log. Console: each part's tail.
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
if [ "${LADDER:-1}" = 1 ]; then
  say "ladder 48B batch ${B:-1} with ${#VARGS[@]} variants"
  timeout ${TL:-200} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B:-1} --context 512 \
    --device cuda --quick --time-budget $(( ${TL:-200} - 30 )) "${VARGS[@]}" --out $OUT/l48 > $OUT/ladder9a.log 2>&1
  say "ladder: exit $?"
  mv $OUT/l48/traces/* $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
  for md in $OUT/ladder_*.md; do grep -E "^\| (arm|r1[0-9]|v-)|^- (batch|v-|routing|tolerance)" "$md"; done
  grep -E "v-.*(FAILED|over the tolerance)" $OUT/ladder9a.log
fi
for job in ${JOBS:-}; do
  [ -f tools/gpu_$job.sh ] || { say "$job: no tools/gpu_$job.sh"; continue; }
  lim_var=LIMIT_$job; lim=${!lim_var:-110}
  mkdir -p $OUT/$job
  say "$job (limit $lim s)"
  OUT=$OUT/$job R=$OUT/$job/r timeout -s INT $lim bash tools/gpu_$job.sh > $OUT/$job/console.log 2>&1
  say "$job: exit $?"; rm -rf $OUT/$job/r
  tail -40 $OUT/$job/console.log
done
say "done"
