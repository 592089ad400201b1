#!/usr/bin/env bash
# Session 18's H200 calls (issue 9), each < 10 min warm; carry .whl/. Session 17's arms (tools/gpu_s17.sh: its
# ladder() and variants) plus an attributed profile (tools/profile_engine_step.py: the attribution run's node table,
# so `k3compile report` on CPU gives the per-node roofline and per-layer table no ladder trace has).
#   PART=48b   (needs the H200's memory) gpu_s17's 48b part, then the 48B batch-1 attributed profile (PROF48=0: skip)
#   PART=mini  gpu_s17's mini part (GPU tests of tests/passes, k3-mini-6b batch 1 with v-front, v-front8, v-rpf),
#              then the k3-mini-6b batch-1 attributed profile
#   PART=one   (H200; if one call is all that comes) gpu_s17's one part (changed GPU tests, k3-mini-6b and the 48B at
#              batch 1 with the arms), then the k3-mini-6b profile; e.g. TESTS_TL=120 T6=140 T48=150 PROF_TL=90
# Back in $OUT: as gpu_s17.sh, plus profile_<model>_bs1.json.gz and logs/profile_<model>.log.
set -u
PART=${PART:-mini}
bash tools/gpu_s17.sh || echo "gpu_s17 exit $?"
source tools/gpu_setup.sh
profile() {  # model, time limit (s)
  local t=$SECONDS
  timeout $2 python3 tools/profile_engine_step.py --model $1 --dtype bf16 --batch 1 --context 512 \
    --out $OUT/profile_$1_bs1.json.gz > $OUT/profile_$1.log 2>&1
  echo "[profile $1: exit $?, $((SECONDS - t)) s]" | tee -a $OUT/call.log; tail -3 $OUT/profile_$1.log
}
case $PART in
  48b) [ "${PROF48:-1}" = 1 ] && profile kimi-linear-48b ${PROF_TL:-150} ;;
  mini) profile k3-mini-6b ${PROF_TL:-120} ;;
  one) profile k3-mini-6b ${PROF_TL:-90} ;;
esac
ls -la $OUT
