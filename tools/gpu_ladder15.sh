#!/usr/bin/env bash
# Session 15 (issue 9, deliver 4): the ladder at batch 1 / 8 / 64 with session 15's defaults (P8 rows_programs
# 132,264,528; P6 latent_prewait + down_early_release; MLA W_UV merge up to 8 tokens), both shapes, no torch.compile
# arm (k3-mini's first compile alone is 148-193 s) and no transformers process (48B anchors: traces/h200_s13/call2).
#   1. Kimi-Linear-48B-A3B shape, batch 1,8,64 (T48 s of time budget; the JSON / markdown are written per batch)
#   2. k3-mini-6b, batch 1,8,64 (T6 s)
#   run: bash tools/gpu_ladder15.sh   (carry .whl/); ~T48 + T6 + 60 s
# Back in $OUT: l48_ladder_*.{md,json,png}, l6_ladder_*.{md,json,png}, call.log, logs.tar (ladder logs)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
mkdir -p $OUT/logs
T48=${T48:-280}; T6=${T6:-200}
timeout $((T48 + 40)) k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8,64 --context 512 \
  --device cuda --quick --time-budget $T48 --out $OUT/l48 > $OUT/logs/ladder48.log 2>&1
say "48B: exit $?"
timeout $((T6 + 40)) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1,8,64 --context 512 \
  --device cuda --quick --time-budget $T6 --out $OUT/l6 > $OUT/logs/ladder6.log 2>&1
say "k3-mini: exit $?"
for d in l48 l6; do rm -rf $OUT/$d/traces; for f in $OUT/$d/ladder_*; do mv "$f" "$OUT/${d}_$(basename $f)"; done; rm -rf $OUT/$d; done
for md in $OUT/*.md; do
  echo "== $md"; grep -E "^\| (arm|r[0-9]+|eager|graphs)" "$md" | cut -c1-240 | head -22; grep -E "^- (batch|routing|tolerance)" "$md"
done
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"
