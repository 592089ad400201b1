#!/usr/bin/env bash
# Session 14, call 3 (the session's last ~660 s of device time):
#   1. 48B ladder at batch 1/8 with the k3-mini winners of call 2 (traces/h200_s14, from its ladder log: v-rp
#      1.755-1.760 ms and v-cpbd 1.768 against engine-after's 1.836-1.837) before either becomes a default:
#      rp = P8 rows_programs 132+264+528, cpbd = P6 latent_prewait + down_early_release, both together.
#      (cpbd alone only with CPBD48=1: both against rp says what cpbd adds.) No --keep-traces (call 2's profiling after the time budget ran past the outer time-out).
#   2. the k3-mini ladder again with the same three variants and no torch.compile (call 2's ladder was killed before
#      it wrote its table: its figures are only in its log; this one gives the kernel counts and `both`).
#      Only with MINI=1 (+~170 s).
#   Two refused starts cost 212 s of the budget, so the TTFT breakdown (tools/gpu_ttft13.sh) does not fit this session.
#   run: bash tools/gpu_call14c.sh   (carry .whl/ with fla-core), ~200 s after set-up (MINI=1: ~370 s).
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
P6=p06_fused_moe_decode; P8=p08_small_m_gemm
RP="$P8.rows_programs=132+264+528"; CP="$P6.latent_prewait=true,$P6.down_early_release=true"
mkdir -p $OUT/l48
timeout ${T48:-200} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8 --context 512 \
  --device cuda --quick --time-budget ${TL:-150} --variant "rp:$RP" ${CPBD48:+--variant "cpbd:$CP"} --variant "both:$RP,$CP" \
  --out $OUT/l48 > $OUT/l48/ladder.log 2>&1
say "48B ladder with variants: exit $?"
grep -hE "^\| (arm|r04|r1[4-9]|v-)" $OUT/l48/ladder_*.md 2>/dev/null | cut -c1-200
grep -E "rep [0-9]+/" $OUT/l48/ladder.log | tail -2 | cut -c1-600
(cd $OUT && tar cf l48.tar l48 && rm -rf l48)
if [ "${MINI:-0}" = 1 ]; then
mkdir -p $OUT/l6
timeout ${T6:-170} k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
  --device cuda --quick --time-budget ${TL6:-130} --variant "rp:$RP" --variant "cpbd:$CP" --variant "both:$RP,$CP" \
  --out $OUT/l6 > $OUT/l6/ladder.log 2>&1
say "k3-mini ladder with variants: exit $?"
grep -hE "^\| (arm|eager|r04|r1[4-9]|v-)" $OUT/l6/ladder_*.md 2>/dev/null | cut -c1-200
grep -E "rep [0-9]+/" $OUT/l6/ladder.log | tail -2 | cut -c1-600
(cd $OUT && tar cf l6.tar l6 && rm -rf l6)
fi
say "done"
