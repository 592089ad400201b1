#!/usr/bin/env bash
# Session 10 (issue 9, "serve runs the engine the ladder measured"): k3-mini-6b built by `k3compile build` with the
# default pipeline, then, in the same device call:
#   1. `serve ENGINE --enable-unified-memory` (prefix cache on, the default): 16 concurrent completions
#      (tools/serve_check.py) and `bench serve` at concurrency 1 and 8 (128-token prompts, 64 output tokens);
#   2. the server stopped, `bench decode --engine ENGINE --arms engine` at batch 1 and 8: the step of exactly the
#      engine `serve` ran, to hold the served inter-token latency against.
# (The Kimi-Linear-48B engine, ~98 GB of weights, does not fit this machine's 64 GB disk: it is measured in-process
# by `bench ladder`, whose last rung is the pipeline `build` runs.)
#   run: bash tools/gpu_serve10.sh   (carry .whl/: fla-core and the server wheels)
# Back in $OUT: summary.txt, build.log, serve.log, serve_check.txt, serve_c{1,8}.json, decode_engine.md
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/summary.txt; }
timeout 240 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $OUT/build.log 2>&1; say "build: exit $?"
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/build.log; exit 1; }
python3 -c "import json; m=json.load(open('$ENGINE/engine.json')); print('pipeline:', [p['name'] for p in m.get('passes', m.get('reports', {}).get('decode', {}).get('passes', []))][:20])" 2>/dev/null | tee -a $OUT/summary.txt
k3compile serve --model $ENGINE --device cuda --port 30000 --enable-unified-memory > $OUT/serve.log 2>&1 &
PID=$!
for _ in $(seq 200); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
say "serve healthy"
timeout 120 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1; say "serve_check: exit $?"
for c in 1 8; do
  timeout 120 k3compile bench serve --base-url http://127.0.0.1:30000 --dataset fixed --input-len 128 --output-len 64 \
    --num-prompts $((c * 4)) --max-concurrency $c --label c$c --out $OUT/bs > $OUT/bench_c$c.log 2>&1
  say "bench serve c=$c: exit $?"; grep -i -E "itl|tpot|ttft|throughput" $OUT/bench_c$c.log | head -8 | tee -a $OUT/summary.txt
done
kill $PID; wait $PID 2>/dev/null
mv $OUT/bs/*.json $OUT/ 2>/dev/null; rm -rf $OUT/bs
timeout 150 k3compile bench decode --engine $ENGINE --arms engine --batch 1,8 --context 512 --device cuda --steps 40 \
  --reps 5 --warmup 20 --time-budget 120 --out $OUT/dec > $OUT/decode.log 2>&1; say "bench decode: exit $?"
cp $OUT/dec/*.md $OUT/decode_engine.md 2>/dev/null; rm -rf $OUT/dec
grep -E "^\| (arm|engine)" $OUT/decode_engine.md | tee -a $OUT/summary.txt
grep -i -E "memory|warm-up" $OUT/serve.log | head -4 | tee -a $OUT/summary.txt
cat $OUT/serve_check.txt
say "done"
