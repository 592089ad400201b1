#!/usr/bin/env bash
# Session 17's first H200 call (issue 9), prepared in session 16 (traces/h200_s16/closing_note16.md), ~500 s warm:
#   1. the GPU tests of tests/passes with session 16's default (P6 grouped_sorted on), which session 16 ran only for
#      P6 and kernels/moe_sorted.py: 4 workers, one file per worker, under TESTS_TL (default 240 s; session 15: 237 s)
#   2. the A/B of session 16's two unmeasured P6 options, one ladder at batch 1 and 64 (TL, default 220 s):
#      v-finish  sorted_finish (the sorted path's pair sum + K3's latent RMSNorm in one kernel; acts at batch 64)
#      v-rpf     routed_l2_prefetch (B''s routed W2 rows asked of L2 before its gdc_wait; acts at batch 1)
#      on k3-mini-6b; MORE=1 adds the 48B shape (a second call is safer: ~200 s)
#   run: bash tools/gpu_next17.sh   (carry .whl/). Then the 48B all-anchor run in its own call:
#        HF_BUDGET=160 T48=280 C48=130 bash tools/gpu_ladder3.sh
# Back in $OUT: ladder_k3-mini-6b_bf16.{md,json,png} (and the 48B one with MORE=1), call.log, logs.tar (tests.log,
# the ladders' logs)
source tools/gpu_setup.sh
mkdir -p $OUT/logs
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
timeout ${TESTS_TL:-240} python3 -m pytest -q -m gpu -n 4 --dist loadfile -p no:cacheprovider tests/passes \
  > $OUT/logs/tests.log 2>&1
say "tests/passes (gpu): exit $?"; tail -3 $OUT/logs/tests.log; grep -E "^FAILED" $OUT/logs/tests.log | head -20
V=(--variant "finish:p06_fused_moe_decode.sorted_finish=true" --variant "rpf:p06_fused_moe_decode.routed_l2_prefetch=true")
for model in k3-mini-6b $([ "${MORE:-0}" = 1 ] && echo kimi-linear-48b); do
  timeout $(( ${TL:-220} + 30 )) k3compile bench ladder --model $model --dtype bf16 --batch 1,64 --context 512 \
    --device cuda --quick --time-budget ${TL:-220} "${V[@]}" --out $OUT/l > $OUT/logs/ladder_$model.log 2>&1
  say "ladder $model: exit $?"
  cp $OUT/l/ladder_*.json $OUT/l/ladder_*.md $OUT/l/ladder_*.png $OUT/ 2>/dev/null
  grep -E "^\| (r04|r16|v-)|^- v-" $OUT/l/ladder_*.md | head -8
  (cd $OUT/l && tar cf $OUT/traces_$model.tar traces/*r16*_bs1.* 2>/dev/null)  # `k3compile report` on CPU
  rm -rf $OUT/l
done
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"; ls -la $OUT
