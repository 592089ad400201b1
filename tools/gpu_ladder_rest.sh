#!/usr/bin/env bash
# The rest of a ladder call that ran out of time (session 7): the 48B shape at batch 64 alone, then k3-mini-6b at
# batch 1 and 8, no torch.compile arm (its compile alone is ~110 s per batch size). One device call, < 5 minutes.
#   run: bash tools/gpu_ladder_rest.sh   (carry .whl/)
source tools/gpu_setup.sh
T0=$SECONDS
timeout ${T64:-150} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 64 --context 512 --device cuda \
  --quick --time-budget $(( ${T64:-150} - 30 )) --out $OUT/l48 > $OUT/ladder_48b_bs64.log 2>&1
echo "48B bs64: exit $? ($((SECONDS - T0)) s)"
timeout ${T6:-130} k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1,8 --context 512 --device cuda \
  --quick --time-budget $(( ${T6:-130} - 30 )) --out $OUT/l6 > $OUT/ladder_k3-mini.log 2>&1
echo "k3-mini: exit $? ($((SECONDS - T0)) s)"
for d in l48 l6; do rm -rf $OUT/$d/traces; for f in $OUT/$d/ladder_*; do mv "$f" "$OUT/${d}_$(basename $f)"; done; done
for md in $OUT/*.md; do echo "== $md"; grep -E "^\| (arm|r[0-9]+|eager)" "$md" | head -20; grep -E "^- (batch|routing|tolerance)" "$md"; done
