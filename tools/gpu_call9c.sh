#!/usr/bin/env bash
# Session 9, device call 3 (issue 9): the ladder's remaining rows with the final defaults (48B batch 64, k3-mini-6b
# batch 1 [8 if time is left]), then the GPU test suite. Everything in one tar (a call returns at most 8 files).
#   run: T64=150 T6=120 SUITE_LIMIT=240 bash tools/gpu_call9c.sh   (carry .whl/)
source tools/gpu_setup.sh
T0=$SECONDS
FINAL=$OUT
mkdir -p $FINAL/rest $FINAL/suite
OUT=$FINAL/rest bash tools/gpu_ladder_rest.sh 2>&1 | tail -40
echo "[$((SECONDS - T0)) s] ladder rest done"
timeout -s INT ${SUITE_LIMIT:-240} python3 -m pytest -q -m gpu -n ${SUITE_WORKERS:-8} --dist loadfile -p no:cacheprovider \
  -o faulthandler_timeout=150 --durations=25 -rs tests > $FINAL/suite/gpu_tests.log 2>&1
echo "[$((SECONDS - T0)) s] gpu tests: exit $?"; grep -E "passed|failed" $FINAL/suite/gpu_tests.log | tail -1
grep -E "^(FAILED|ERROR)" $FINAL/suite/gpu_tests.log | head -30
(cd $FINAL && tar czf call9c.tar.gz rest suite && rm -rf rest suite)
ls -la $FINAL
