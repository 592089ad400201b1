#!/usr/bin/env bash
# Session 14, call 2 (issue 9): call 1 (tools/gpu_call14.sh) lost the k3-mini ladder: torch.compile's first compile
# of k3-mini-6b finished in 148 s (under no stop), the rungs' set-up took the next 107 s, and the 260 s time budget
# was spent before one repetition was timed. And the trained spec-tiny ladder failed from r14 on (P15's prologue +
# absorption kernel refused r = 16 < its 64-column block; fixed). So, one call:
#   1. tools/gpu_mini13.sh with COMPILE=1, a 220 s compile stop and a 350 s ladder budget (no GEMV sweep, no tests:
#      call 1 ran them): k3-mini-6b batch-1 ladder with eager / torch.compile(reduce-overhead) / before / after and
#      mini13's six variants, reports, budget.
#   2. the trained spec-tiny target's ladder at batch 1/8 with every rung (token agreement at the H200's kernels).
#   run: bash tools/gpu_call14b.sh   (carry .whl/ with fla-core), ~540 s after set-up.
# Back in $OUT: mini_ladder_*.md, trained_ladder_*.md, call.log, all.tar (JSONs, PNGs, reports, logs).
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
mkdir -p $OUT/mini $OUT/trained
(OUT=$OUT/mini R=$OUT/mini/r COMPILE=1 C6=${C6:-220} TL=${TL6:-350} GEMV=0 TESTS=0 bash tools/gpu_mini13.sh) \
  > $OUT/mini/console.log 2>&1
say "k3-mini ladder (gpu_mini13.sh): exit $?"; tail -30 $OUT/mini/console.log | cut -c1-200
for md in $OUT/mini/ladder_*.md; do [ -f "$md" ] && cp "$md" "$OUT/mini_$(basename $md)"; done
timeout 110 k3compile bench ladder --model checkpoints/spec-tiny/target --dtype bf16 --batch 1,8 --context 512 \
  --device cuda --quick --time-budget 85 --out $OUT/trained > $OUT/trained/ladder.log 2>&1
say "trained spec-tiny ladder: exit $?"
grep -hE "^\| (arm|r[0-9]{2})" $OUT/trained/ladder_*.md 2>/dev/null | cut -c1-160 | head -40
for md in $OUT/trained/ladder_*.md; do [ -f "$md" ] && cp "$md" "$OUT/trained_$(basename $md)"; done
(cd $OUT && rm -rf */r */traces && tar cf all.tar mini trained && rm -rf mini trained)
say "done"
