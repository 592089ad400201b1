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
python3 - > $OUT/serve_check.txt 2>&1 <<'PY'
import concurrent.futures as cf, json, re, urllib.request
def post(i):
    body = json.dumps({"model": "mini", "prompt": f"request {i}: " + "x" * (8 * i), "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:30000/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.load(r)["choices"][0]["finish_reason"]
with cf.ThreadPoolExecutor(16) as pool:
    print("16 concurrent completions:", list(pool.map(post, range(16))))
m = urllib.request.urlopen("http://127.0.0.1:30000/metrics").read().decode()
print("\n".join(l for l in m.splitlines() if re.match(r"k3compile_(requests_max_running|kv_pages_total|state_slots_total"
                                                       r"|time_to_first_token_seconds_count|request_errors)", l)))
PY
kill $PID; wait $PID 2>/dev/null
head -5 $OUT/serve.log; cat $OUT/serve_check.txt
