#!/usr/bin/env bash
# Session 11, device call 2 (issue 9).
#   1. GPU tests: moe11's (flag_deps, the 48B kernel A candidates, P6's up_launch + flag_deps) and route11's (P7's tails)
#   2. tools/bench_moe11.py at batch 1 (one 48B MoE layer: kernel A launches, flag_deps, B' launches; op us)
#      -> its `--variant` strings (bench_moe11.ladder_variants) join the ladder below
#   3. bench ladder, Kimi-Linear-48B shape, batch ${B48:-1}: the moe11 variants + route11's tails ($VARIANTS)
#   4. tools/bench_mla_prefill11.py: the MLA prefill's SDPA host time on new shapes, SDPA's choice vs no cuDNN
#   5. k3-mini-6b ladder, batch 1, with the torch.compile(reduce-overhead) anchor (MINI=1)
#   run: VARIANTS="..." TL=170 MINI=1 T6=120 bash tools/gpu_call11b.sh   (carry .whl/)
# Back in $OUT (<= 8 files): ladder_*.{md,json} of both models, moe11.tar (sweep md/json/log), logs.tar (tests,
# ladder logs, mla_prefill.txt, call.log, the PNGs)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
timeout ${TEST_LIMIT:-110} python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_moe_decode.py \
  tests/passes/kernels/test_moe_launch_tables.py tests/passes/test_p06_fused_moe_decode.py \
  -k "flag_deps or 48b_kernel_a or up_launch_and_flag_deps" > $OUT/tests_moe.log 2>&1; say "moe tests: exit $?"
tail -3 $OUT/tests_moe.log
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/test_p07_norm_route.py > $OUT/tests_route.log 2>&1
say "route tests: exit $?"; tail -3 $OUT/tests_route.log
mkdir -p $OUT/moe11
timeout ${SWEEP_LIMIT:-95} python3 tools/bench_moe11.py $OUT/moe11 ${SWEEP_BUDGET:-55} 1 > $OUT/moe11/bench.log 2>&1
say "moe11 sweep: exit $?"; grep -v -i warn $OUT/moe11/bench.log | grep -v '^{' | tail -25
MOEV=$(python3 -c "import sys; sys.path.insert(0, 'tools'); from bench_moe11 import ladder_variants; print(' '.join(ladder_variants('$OUT/moe11')))" 2>>$OUT/call.log)
[ -z "$MOEV" ] && MOEV="flags:p06_fused_moe_decode.flag_deps=true"
say "moe variants: $MOEV"
(cd $OUT && tar cf moe11.tar moe11 && rm -rf moe11)
VARGS=(); for v in $MOEV ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
timeout ${TL:-170} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B48:-1} --context 512 \
  --device cuda --quick --time-budget $(( ${TL:-170} - 30 )) "${VARGS[@]}" --out $OUT/l48 > $OUT/ladder48.log 2>&1
say "ladder 48B: exit $?"
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
grep -E "^\| (arm|r04|r15|v-)|^- (batch|routing|tolerance)" $OUT/ladder_kimi*.md | cut -c1-200
timeout 60 python3 tools/bench_mla_prefill11.py > $OUT/mla_prefill.txt 2>&1; say "mla prefill: exit $?"
grep -v -i warn $OUT/mla_prefill.txt | tail -6
LEFT=$(( ${CALL_LIMIT:-575} - (SECONDS - T0) - 35 )); T6=${T6:-170}; [ $LEFT -lt $T6 ] && T6=$LEFT
if [ "${MINI:-0}" = 1 ] && [ $T6 -gt 90 ]; then
  say "k3-mini ladder with --time-budget $T6"
  timeout $(( $T6 + 30 )) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
    --device cuda --quick --compile --compile-budget ${C6:-60} --time-budget $T6 --out $OUT/l6 \
    > $OUT/ladder6.log 2>&1; say "ladder k3-mini: exit $?"
  mv $OUT/l6/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l6
  grep -E "^\| (arm|eager|compile|r04|r15)|^- (batch|routing)|torch.compile" $OUT/ladder_k3-mini*.md | cut -c1-200
fi
say "done"
(cd $OUT && tar cf logs.tar *.log *.txt *.png 2>/dev/null && rm -f *.log *.txt *.png)
ls $OUT
