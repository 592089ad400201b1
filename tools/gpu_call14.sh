#!/usr/bin/env bash
# Prepared in session 13 for the next session's first device call (issue 9), ~450 s after set-up:
#   1. tools/gpu_mini13.sh with COMPILE=1: k3-mini-6b batch-1 ladder with the torch.compile(reduce-overhead) anchor
#      (Deliver 5: k3-mini's anchors in one run; a compile still running after C6 s is stopped, the rest is timed)
#      and mini13's six variants (P8 rows_programs, P6 latent_prewait / down_early_release, P8 early_release), the
#      reports and budget, the GPU tests of the new options (no GEMV sweep)
#   2. the ladder on the trained k3-tiny target of checkpoints/spec-tiny, batch 1/8: every rung's greedy-token
#      agreement on a trained model at the H200's kernels (Deliver 3; the CPU test is
#      tests/k3compile/engine/test_trained_token_agreement.py)
#   3. (B64=1, +~170 s: then give the call its 600 s) the 48B ladder at batch 64 with today's code (Deliver 4's third
#      batch size; the last one is session 9's)
#   run: bash tools/gpu_call14.sh   (carry .whl/)
# Back in $OUT: the ladder markdowns (mini, trained, b64), call.log, all.tar (everything else: JSONs, PNGs, reports,
# logs, the mini script's own files)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
mkdir -p $OUT/mini $OUT/trained $OUT/b64
(OUT=$OUT/mini R=$OUT/mini/r COMPILE=1 C6=${C6:-100} TL=${TL6:-260} GEMV=0 TEST_EACH=${TEST_EACH:-45} \
  bash tools/gpu_mini13.sh) > $OUT/mini/console.log 2>&1
say "k3-mini ladder (gpu_mini13.sh): exit $?"; tail -25 $OUT/mini/console.log
timeout 130 k3compile bench ladder --model checkpoints/spec-tiny/target --dtype bf16 --batch 1,8 --context 512 \
  --device cuda --quick --time-budget 100 --out $OUT/trained > $OUT/trained/ladder.log 2>&1
say "trained spec-tiny ladder: exit $?"
grep -hE "^\| (arm|r[0-9]{2})" $OUT/trained/ladder_*.md 2>/dev/null | cut -c1-160 | head -40
if [ "${B64:-0}" = 1 ]; then
  timeout 190 k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 64 --context 512 --device cuda \
    --quick --time-budget 165 --out $OUT/b64 > $OUT/b64/ladder.log 2>&1
  say "48B batch 64 ladder: exit $?"
  grep -hE "^\| (arm|eager|r04|r1[4-9])" $OUT/b64/ladder_*.md 2>/dev/null | cut -c1-160
fi
for d in mini trained b64; do
  for md in $OUT/$d/ladder_*.md; do [ -f "$md" ] && cp "$md" "$OUT/${d}_$(basename $md)"; done
done
(cd $OUT && rm -rf */r */traces && tar cf all.tar mini trained b64 && rm -rf mini trained b64)
say "done"
