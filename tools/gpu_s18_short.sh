#!/usr/bin/env bash
# Session 18's last-chance call (~350 s warm, H100 or H200; carry .whl/): the k3-mini-6b batch-1 attributed profile
# (tools/profile_engine_step.py, for `k3compile report` on CPU), the new pass's GPU tests
# (tests/passes/test_p08_small_m_route_gemv.py), then k3-mini-6b at batch 1 with v-front only (PROF_TL, TESTS_TL, T6).
source tools/gpu_setup.sh
mkdir -p $OUT/logs
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
timeout ${PROF_TL:-80} python3 tools/profile_engine_step.py --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
  --out $OUT/profile_k3-mini-6b_bs1.json.gz > $OUT/logs/profile.log 2>&1
say "profile: exit $?"; tail -2 $OUT/logs/profile.log
timeout ${TESTS_TL:-90} python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/test_p08_small_m_route_gemv.py \
  > $OUT/logs/tests.log 2>&1
say "route_gemv GPU tests: exit $?"; tail -3 $OUT/logs/tests.log
timeout $((${T6:-140} + 30)) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --device cuda \
  --quick --time-budget ${T6:-140} --variant "front:p08_small_m_route_gemv.enabled=true" --out $OUT/l \
  > $OUT/logs/ladder.log 2>&1
say "ladder: exit $?"; cp $OUT/l/ladder_*.{md,json} $OUT/ 2>/dev/null; grep -E "^\| (r04|r16|v-)" $OUT/l/ladder_*.md | head
rm -rf $OUT/l; (cd $OUT && tar cf logs.tar logs && rm -rf logs); ls -la $OUT
