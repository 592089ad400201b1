#!/usr/bin/env bash
# Session 10, device call 5 (issue 9): the final defaults, one device call.
#   1. bench ladder, Kimi-Linear-48B shape, batch 1 and 8 (--quick, no anchors besides eager / engine-before)
#   2. tools/gpu_serve10.sh's served path, trimmed: k3-mini-6b built by `k3compile build`, `serve ENGINE
#      --enable-unified-memory` (prefix cache on), 16 concurrent completions, `bench serve` at concurrency 1
#   3. the GPU tests session 9 fixed without re-running and this session's launch tables
#   run: bash tools/gpu_call10c.sh   (carry .whl/)
# Back in $OUT: ladder_*.{md,json,png}, ladder.log, serve.tar (build/serve logs, serve_check.txt, bench JSON), tests.log
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
timeout ${TL:-200} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8 --context 512 \
  --device cuda --quick --time-budget $(( ${TL:-200} - 30 )) --out $OUT/l48 > $OUT/ladder.log 2>&1
say "ladder: exit $?"
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|r0[4-6]|r1[0-9]|v-)|^- (batch|routing|tolerance)" "$md"; done
S=$OUT/serve; mkdir -p $S
ENGINE=/tmp/engines/mini
timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $S/build.log 2>&1; say "build: exit $?"
if [ -f $ENGINE/engine.json ]; then
  k3compile serve --model $ENGINE --device cuda --port 30000 --enable-unified-memory > $S/serve.log 2>&1 &
  PID=$!
  for _ in $(seq 150); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
  say "serve healthy?"; curl -s localhost:30000/v1/models | head -c 300; echo
  timeout 90 python3 tools/serve_check.py > $S/serve_check.txt 2>&1; say "serve_check: exit $?"; cat $S/serve_check.txt
  timeout 90 k3compile bench serve --base-url http://127.0.0.1:30000 --dataset fixed --input-len 128 --output-len 64 \
    --num-prompts 4 --max-concurrency 1 --label c1 --out $S > $S/bench_c1.log 2>&1
  say "bench serve c=1: exit $?"; grep -v -i warn $S/bench_c1.log | tail -15
  kill $PID; wait $PID 2>/dev/null
  grep -i -E "memory|warm-up|unified" $S/serve.log | head -5
fi
(cd $OUT && tar cf serve.tar serve && rm -rf serve)
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/k3compile/engine/test_profiling_gpu.py \
  tests/passes/kernels/test_moe_launch_tables.py > $OUT/tests.log 2>&1; say "tests: exit $?"; tail -3 $OUT/tests.log
say "done"
