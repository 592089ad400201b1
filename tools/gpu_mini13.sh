#!/usr/bin/env bash
# Session 13, helper mini13 (issue 9): k3-mini-6b batch 1, what stands between 42.6% and 70% of the roofline.
#   1. bench ladder, k3-mini-6b bf16, batch 1, context 512, --quick, options OFF by default as variants (each judged
#      against engine-after by the ladder's pinned accuracy gate, timed interleaved in the same run), in this order
#      (the ladder skips the arms its time budget does not reach):
#        v-rp    P8 rows_programs=132+264+528 (new): fewer-K-split candidates for the rows GEMV. P8's own build timing
#                in session 12 (traces/h200_s12/call4, r09's pass report) put the 29 o_proj GEMVs (2048 x 2048) at
#                6.44 us = 31% of the copy bandwidth with the split-2 tile, ~2 us above every unsplit GEMV's line; the
#                unsplit 4x1024 tile was never a candidate there. P8 measures the new ones at build (~30 s set-up)
#        v-cpbd  P6 latent_prewait + down_early_release: B' releases kernel C right after its wait and C runs its
#                shared expert's down-projection (+ its W_up tile) before gdc_wait, i.e. while B' streams (new)
#        v-cpre  P6 latent_prewait alone (new; without B''s early release C starts only near B''s end)
#        v-bdown P6 down_early_release alone (existing; 48B: no gain, traces/h200_s13/call1)
#        v-gx    P8 early_release=except_kda_inputs (existing; 48B: 0.994x, traces/h200_s12/call3)
#        v-gall  P8 early_release=all (existing; 48B: 1.010x, call1)
#   2. `k3compile report` of engine-after's, v-cpbd's and v-rp's batch-1 traces; tools/decode_budget.py with engine-after's
#      report: bytes, floor and measured us per kernel kind
#   3. tools/bench_gemv.py --p8 --mini: P8's own measurement at k3-mini's 8 GEMM shapes, M = 1, timing pdl_chain, with the
#      rows_programs candidates: us and GB/s per shape (per-shape GEMV times: a trace gives one name for all 89)
#   4. GPU tests: latent_prewait's same bits (k3-mini latent shape, eager + CUDA graphs), rows_programs' candidates
#   run: TL=170 bash tools/gpu_mini13.sh   (carry .whl/ as for the other gpu_*.sh); ~200 s for the ladder and reports
#        (COMPILE=1 C6=120 TL=300: with the torch.compile anchor, at most C6 s of compiling),
#        ~60-90 s the GEMV sweep (GEMV=0: skip), ~60 s the tests (TESTS=first|last|0)
# Back in $OUT: ladder_k3-mini-6b_bf16.{md,json,png}, call.log, report_after.json, budget.md, gemv13.txt, logs.tar
# (tests.log, ladder.log, report_after.txt, report_{cpbd,rp}.{txt,json}, gemv13.json)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
run_tests() {
  run_gpu_tests ${TEST_EACH:-80} \
    "tests/passes/kernels/test_moe_decode.py::latent_prewait" \
    "tests/passes/test_p08_small_m_gemm.py::rows_programs"
}
mkdir -p $OUT/logs
[ "${TESTS:-last}" = first ] && run_tests
P6=p06_fused_moe_decode; P8=p08_small_m_gemm
VARIANTS="rp:$P8.rows_programs=132+264+528 cpbd:$P6.latent_prewait=true,$P6.down_early_release=true"
VARIANTS="$VARIANTS cpre:$P6.latent_prewait=true bdown:$P6.down_early_release=true"
VARIANTS="$VARIANTS gx:$P8.early_release=except_kda_inputs gall:$P8.early_release=all"
VARGS=(); for v in $VARIANTS; do VARGS+=(--variant "$v"); done
# COMPILE=1: the torch.compile(reduce-overhead) anchor in the same run (issue 9 Deliver 5), stopped after C6 s of
# compiling (a cold k3-mini-6b compile ran past 190 s in session 13; the ladder now stops it and times the rest)
CARGS=(); [ "${COMPILE:-0}" = 1 ] && CARGS=(--compile --compile-budget ${C6:-120})
timeout $(( ${TL:-170} + 30 )) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
  --device cuda --quick --time-budget ${TL:-170} --keep-traces all "${VARGS[@]}" ${CARGS[@]+"${CARGS[@]}"} --out $OUT/l6 \
  > $OUT/logs/ladder.log 2>&1
say "ladder: exit $?"
TR=$(ls $OUT/l6/traces/*_r[0-9][0-9]-*bs1.json.gz 2>/dev/null | sort | tail -1)  # the last rung: engine-after
[ -n "$TR" ] && timeout 60 k3compile report "$TR" --top 30 --json $OUT/report_after.json > $OUT/logs/report_after.txt 2>&1
for v in cpbd rp; do
  TV=$(ls $OUT/l6/traces/*v-${v}_bs1.json.gz 2>/dev/null | tail -1)
  [ -n "$TV" ] && timeout 60 k3compile report "$TV" --top 30 --json $OUT/logs/report_$v.json > $OUT/logs/report_$v.txt 2>&1
done
say "reports: ${TR:-none} $(ls $OUT/logs/report_*.txt 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
mv $OUT/l6/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l6
LJ=$OUT/ladder_k3-mini-6b_bf16.json
[ -f $OUT/report_after.json ] && [ -f $LJ ] && \
  python3 tools/decode_budget.py k3-mini-6b --report $OUT/report_after.json --ladder $LJ > $OUT/budget.md 2>&1
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|eager|r04|r1[45]|v-)|^- (batch|routing|tolerance)" "$md" | cut -c1-200; done
grep -E "$P6|$P8" $OUT/logs/ladder.log | grep -iE "v-|variant" | head -8
for r in $OUT/logs/report_after.txt $OUT/logs/report_cpbd.txt $OUT/logs/report_rp.txt; do
  [ -f $r ] && { echo "== $r"; grep -A12 "^Top GPU kernels" $r | cut -c1-110; }
done
[ -f $OUT/budget.md ] && tail -4 $OUT/budget.md
if [ "${GEMV:-1}" = 1 ]; then
  timeout ${TG:-120} python3 tools/bench_gemv.py --p8 --mini --timing pdl_chain --buckets 1 \
    --rows-programs 132+264+528+1056 --json $OUT/logs/gemv13.json > $OUT/gemv13.txt 2>&1
  say "gemv sweep: exit $?"
  grep -E "choice|M= 1" $OUT/gemv13.txt | cut -c1-150
fi
[ "${TESTS:-last}" = last ] && run_tests
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"
