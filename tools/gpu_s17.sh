#!/usr/bin/env bash
# Session 17's H200 calls (issue 9), each < 10 min warm; carry .whl/. PART picks the call:
#   PART=48b   (needs the H200's memory) Kimi-Linear-48B ladder at batch 1 and 8 with the arm v-rpf (P6's
#              routed_l2_prefetch: B''s routed W2 rows asked of L2 before its gdc_wait; acts at batch 1), then
#              k3-mini-6b at batch 8 and 64 with v-finish (P6's sorted_finish; acts at 64) and v-front (pass
#              p08_small_m_route_gemv: the MoE front GEMV in the norm_route launch; acts up to batch 8)
#   PART=mini  the GPU tests of tests/passes (4 workers, one file per worker, TESTS_TL, default 230 s), then
#              k3-mini-6b at batch 1 with v-front (16 front rows a program), v-front8 (8 rows) and v-rpf
#   PART=one   (needs the H200's memory; for a session that may get one call only, ~400 s warm) the GPU tests that
#              changed since they last ran on a GPU (TESTS_TL, default 150 s), then k3-mini-6b at batch 1 with v-front,
#              v-front8 and v-rpf, then the 48B at batch 1 with v-rpf
# Back in $OUT: ladder_<model>_bf16.{md,json,png} per ladder (renamed with the part's tag), traces_<model>.tar
# (engine-after's batch-1 trace, for `k3compile report` on CPU), call.log, logs.tar
source tools/gpu_setup.sh
mkdir -p $OUT/logs
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
RPF="rpf:p06_fused_moe_decode.routed_l2_prefetch=true"
FIN="finish:p06_fused_moe_decode.sorted_finish=true"
FRONT="front:p08_small_m_route_gemv.enabled=true"
FRONT8="front8:p08_small_m_route_gemv.enabled=true,p08_small_m_route_gemv.front_block=8"  # 256 front programs, not 128
ladder() {  # tag, model, batches, time budget (s), variants...
  local tag=$1 model=$2 batches=$3 budget=$4; shift 4
  local V=(); for v in "$@"; do V+=(--variant "$v"); done
  timeout $((budget + 40)) k3compile bench ladder --model $model --dtype bf16 --batch $batches --context 512 \
    --device cuda --quick --time-budget $budget "${V[@]}" --out $OUT/l > $OUT/logs/ladder_$tag.log 2>&1
  say "ladder $tag ($model, batch $batches): exit $?"
  for f in $OUT/l/ladder_*.{md,json,png}; do [ -f "$f" ] && cp "$f" "$OUT/${tag}_$(basename $f)"; done
  grep -E "^\| (r04|r16|v-)|^- v-|^- batch" $OUT/l/ladder_*.md | head -12
  [ -d $OUT/l/traces ] && (cd $OUT/l && tar cf $OUT/traces_$tag.tar traces/*r16*_bs1.* 2>/dev/null)
  rm -rf $OUT/l
}
case ${PART:-mini} in
  48b)
    ladder 48b kimi-linear-48b 1,8 ${T48:-260} "$RPF"
    ladder mini864 k3-mini-6b 8,64 ${T6:-220} "$FIN" "$FRONT" ;;
  mini)
    timeout ${TESTS_TL:-230} python3 -m pytest -q -m gpu -n 4 --dist loadfile -p no:cacheprovider tests/passes \
      > $OUT/logs/tests.log 2>&1
    say "tests/passes (gpu): exit $?"; tail -3 $OUT/logs/tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/tests.log | head -20
    ladder mini1 k3-mini-6b 1 ${T6:-230} "$FRONT" "$FRONT8" "$RPF" ;;
  one)
    timeout ${TESTS_TL:-150} python3 -m pytest -q -m gpu -n 4 --dist loadfile -p no:cacheprovider \
      tests/passes/kernels/test_moe_sorted.py tests/passes/test_p08_small_m_route_gemv.py \
      tests/passes/test_p07_norm_route.py "tests/passes/kernels/test_moe_decode.py::test_cuda_routed_l2_prefetch_gives_the_same_bits" \
      tests/passes/test_p06_fused_moe_decode.py -k "cuda" > $OUT/logs/tests.log 2>&1
    say "changed GPU tests: exit $?"; tail -3 $OUT/logs/tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/tests.log | head -20
    ladder mini1 k3-mini-6b 1 ${T6:-150} "$FRONT" "$FRONT8" "$RPF"
    ladder 48b1 kimi-linear-48b 1 ${T48:-150} "$RPF" ;;
esac
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"; ls -la $OUT
