#!/usr/bin/env bash
# Session 11, device call 2 (issue 9).
#   1. GPU tests of this session's kernels ($TESTS, with -k "$TESTK" when set)
#   2. helpers' device scripts ($JOBS: tools/gpu_<job>.sh each, with its own limit LIMIT_<job>)
#   3. bench ladder, Kimi-Linear-48B shape, batch 1 and 8, whole-engine variants ($VARIANTS: NAME:pass.opt=v,...)
#   4. tools/bench_mla_prefill11.py: the MLA prefill's SDPA host time on new shapes, SDPA's choice vs no cuDNN
#   5. k3-mini-6b ladder, batch 1 and 8, with the torch.compile(reduce-overhead) anchor (MINI=1)
#   run: TESTS="..." JOBS="..." VARIANTS="..." TL=200 MINI=1 T6=150 bash tools/gpu_call11b.sh   (carry .whl/)
# Back in $OUT (<= 8 files): <job>.tar, ladder_*.{md,json} of both models, logs.tar (tests.log, ladder logs,
# mla_prefill.txt, call.log, the PNGs)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_LIMIT:-90} python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS ${TESTK:+-k "$TESTK"} \
    > $OUT/tests.log 2>&1; say "tests: exit $?"; tail -4 $OUT/tests.log
fi
for job in ${JOBS:-}; do
  lim=LIMIT_$job; mkdir -p $OUT/$job
  OUT=$OUT/$job timeout ${!lim:-120} bash tools/gpu_$job.sh > $OUT/$job/console.log 2>&1; say "$job: exit $?"
  tail -40 $OUT/$job/console.log
  (cd $OUT && tar cf $job.tar $job && rm -rf $job)
done
VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done
timeout ${TL:-200} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch ${B48:-1,8} --context 512 \
  --device cuda --quick --time-budget $(( ${TL:-200} - 30 )) "${VARGS[@]}" --out $OUT/l48 > $OUT/ladder48.log 2>&1
say "ladder 48B: exit $?"
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
grep -E "^\| (arm|r04|r15|v-)|^- (batch|routing|tolerance)" $OUT/ladder_kimi*.md | cut -c1-220
timeout 60 python3 tools/bench_mla_prefill11.py > $OUT/mla_prefill.txt 2>&1; say "mla prefill: exit $?"
cat $OUT/mla_prefill.txt | grep -v -i warn | tail -6
if [ "${MINI:-0}" = 1 ]; then
  timeout $(( ${T6:-150} + 30 )) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1,8 --context 512 \
    --device cuda --quick --compile --compile-budget ${C6:-60} --time-budget ${T6:-150} --out $OUT/l6 \
    > $OUT/ladder6.log 2>&1; say "ladder k3-mini: exit $?"
  mv $OUT/l6/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l6
  grep -E "^\| (arm|eager|compile|r04|r15)|^- (batch|routing)|torch.compile" $OUT/ladder_k3-mini*.md | cut -c1-220
fi
say "done"
(cd $OUT && tar cf logs.tar *.log *.txt *.png 2>/dev/null && rm -f *.log *.txt *.png)
ls $OUT
