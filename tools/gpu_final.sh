#!/usr/bin/env bash
# Session 3, last kernel call: one k3-mini-6b engine built by `k3compile build` (all passes) and used three ways:
#   1. an attributed profile of its decode step (tools/profile_engine_step.py --engine), reported on CPU afterwards;
#   2. `serve` of that engine with default memory flags, 16 concurrent completions (issue 10);
#   3. `bench ladder` of k3-mini-6b at batch 1 and 8 (the rungs after the P6 fix).
# The device image has no fastapi/uvicorn/pydantic (and fastapi 0.165 imports opentelemetry-api, with its own
# requirements): carry all their wheels in .whl/ (tools/gpu_setup.sh installs every
# wheel there). LADDER=0 skips part 3.
# Back in $OUT: build.log, engine_attributed_k3-mini-6b_bs1.json.gz, serve.log, serve_check.txt,
# ladder_k3-mini-6b_bf16.{json,md,png}, ladder.log.
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
T0=$SECONDS
timeout 240 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/build.log
grep -E "p0|p1|saving|error|Error" $OUT/build.log | tail -14
timeout 120 python3 tools/profile_engine_step.py --engine $ENGINE --model k3-mini-6b --dtype bf16 --batch 1 \
  --context 512 --steps 3 --out $OUT/engine_attributed_k3-mini-6b_bs1.json.gz 2>&1 | grep -v -i warn | tail -5
echo "profile done ($((SECONDS - T0)) s)"
k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve.log 2>&1 &
PID=$!
for _ in $(seq 180); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
echo "serve healthy after $((SECONDS - T0)) s"
timeout 120 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1
kill $PID; wait $PID 2>/dev/null
grep -i -E "memory|sized|slots|warm" $OUT/serve.log | head -6; cat $OUT/serve_check.txt
echo "serve check done ($((SECONDS - T0)) s)"
[ "${LADDER:-1}" = "1" ] && timeout 150 k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1,8 --context 512 --device cuda \
  --steps 40 --reps 5 --warmup 20 --time-budget 130 --out $R/ladder 2>&1 | grep -v -i warn > $OUT/ladder.log
cp $R/ladder/ladder_*.json $R/ladder/ladder_*.md $R/ladder/ladder_*.png $OUT/ 2>/dev/null; rm -rf $R
grep -A14 "^| arm |" $OUT/ladder_*.md 2>/dev/null
echo "all done ($((SECONDS - T0)) s)"
