#!/usr/bin/env bash
# `serve` of a k3-mini-6b engine on the H200 with default memory flags admits concurrent requests.
#   run: bash tools/gpu_serve_check.sh   (carry .whl/ for fla-core)
# Look at: $OUT/serve.log's first lines ("memory: ... tokens of KV ..., N state slots; up to M requests
# running"), $OUT/serve_check.txt (16 concurrent completions: status and finish reasons; /metrics
# running/max_running and the latency histograms' counts).
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
timeout 300 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  2>&1 | tail -5 | tee $OUT/build.log
[ -f $ENGINE/engine.json ] || { echo "build failed (see build.log)"; exit 1; }
k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve.log 2>&1 &
PID=$!
for _ in $(seq 240); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1
kill $PID; wait $PID 2>/dev/null
head -5 $OUT/serve.log; cat $OUT/serve_check.txt
