#!/usr/bin/env bash
# Session 12, helper mini12 (issue 9): k3-mini-6b's decode launches per layer, three fusions OFF by default.
#   1. bench ladder, k3-mini-6b bf16, batch 1, context 512, --quick, the options as variants (each judged against
#      engine-after by the ladder's pinned accuracy gate, timed interleaved in the same run):
#        v-gate  P15 gate_out        (-2 launches per MLA layer: 16 a step)
#        v-qnorm P15 q_norm_gemv     (-1 per MLA layer where P8 chose k3.gemv for q_b: 8 a step)
#        v-glu   P17 dense GLU       (-11 a step: the dense layer's SiTU-GLU chain)
#        v-all3  all three           (323 -> 288 kernels a step, 11.1 -> 9.9 per layer, tools/kernels_per_layer.py)
#   2. `k3compile report` of engine-after's and v-all3's batch-1 traces (top kernels)
#   3. GPU tests of the new kernel paths at k3-mini-6b shapes, one file at a time: MLA merge + W_UV + output gate
#      (gate_out), the dense GLU kernel (P17), the q_a norm in the q_b GEMV (q_norm_gemv)
#   run: TL=170 bash tools/gpu_mini12.sh   (carry .whl/ as for the other gpu_*.sh; ~300 s wall)
# TESTS=first|last|0: the GPU tests before the ladder, after it (default), or not at all.
# Back in $OUT: ladder_k3-mini-6b_bf16.{md,json,png}, call.log, report_after.{txt,json}, report_all3.json, logs.tar
# (tests.log, ladder.log, report_all3.txt)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
run_tests() {
  run_gpu_tests ${TEST_EACH:-80} \
    "tests/passes/kernels/test_mla_decode.py::output_gate" \
    "tests/passes/kernels/test_glu_act.py::cuda" \
    "tests/passes/test_p15_mla_decode.py::q_norm_gemv"
}
mkdir -p $OUT/logs
[ "${TESTS:-last}" = first ] && run_tests
VARIANTS="gate:p15_mla_decode.gate_out=true qnorm:p15_mla_decode.q_norm_gemv=true glu:p17_dense_glu.enabled=true"
VARIANTS="$VARIANTS all3:p15_mla_decode.gate_out=true,p15_mla_decode.q_norm_gemv=true,p17_dense_glu.enabled=true"
VARGS=(); for v in $VARIANTS; do VARGS+=(--variant "$v"); done
timeout $(( ${TL:-170} + 20 )) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
  --device cuda --quick --time-budget ${TL:-170} --keep-traces all "${VARGS[@]}" --out $OUT/l6 \
  > $OUT/logs/ladder.log 2>&1
say "ladder: exit $?"
TR=$(ls $OUT/l6/traces/*_r[0-9][0-9]-*bs1.json.gz 2>/dev/null | sort | tail -1)  # the last rung: engine-after
[ -n "$TR" ] && timeout 60 k3compile report "$TR" --top 30 --json $OUT/report_after.json > $OUT/report_after.txt 2>&1
TV=$(ls $OUT/l6/traces/*v-all3_bs1.json.gz 2>/dev/null | tail -1)
[ -n "$TV" ] && timeout 60 k3compile report "$TV" --top 30 --json $OUT/report_all3.json > $OUT/logs/report_all3.txt 2>&1
say "reports: ${TR:-none} ${TV:-none}"
mv $OUT/l6/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l6
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|eager|r04|r1[45]|v-)|^- (batch|routing|tolerance)" "$md" | cut -c1-200; done
grep -E "p15_mla_decode|p17_dense_glu" $OUT/logs/ladder.log | head -8
for r in $OUT/report_after.txt $OUT/logs/report_all3.txt; do
  [ -f $r ] && { echo "== $r"; grep -A14 "^Top GPU kernels" $r | cut -c1-120; }
done
[ "${TESTS:-last}" = last ] && run_tests
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"
