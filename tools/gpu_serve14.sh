#!/usr/bin/env bash
# Issue 14 on the H200, one device call (< 6 min): the served path against the engine's own step.
#   run: bash tools/gpu_serve14.sh   (carry .whl/: fla-core and the server wheels, see tools/gpu_setup.sh)
# 1. build a k3-mini-6b engine (bf16);
# 2. `serve` it with the issue's table flags (unified memory, 40 GB pools) and otherwise default flags
#    (overlap, mixed prefill+decode batches, warm-up before /health); time from start to /health OK;
# 3. `bench serve`: the first request after /health (its TTFT is the "warmup" entry) vs warm requests;
#    fixed 128-token prompts, 128 output tokens, greedy SSE streams at concurrency 1, 8, 64 (4, 8, 64
#    requests: the 64 arrive at once, so the c64 run's TTFT p99 is the "64 concurrent prompts" figure);
#    --engine-step times the engine's own decode step at batch 1, 8, 64 on the same lengths, and one
#    prompt's prefill, in the bench process.
# Back in $OUT: build.log, serve.log (look for "warm-up took"), serve_k3-mini-6b.json (runs[].median_itl_ms,
# itl_p50_over_engine_step, p99_ttft_ms, ttft_p99_over_single_prefill, warmup[0].ttft_ms; engine_step.batches),
# serve_k3-mini-6b.png when matplotlib is on the device (else: python -m k3compile.bench.serve_plot JSON here),
# bench.log, summary.txt.
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
T0=$SECONDS
timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/build.log
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/build.log; exit 1; }
T1=$SECONDS
k3compile serve $ENGINE --device cuda --port 30000 --enable-unified-memory --memory-bytes 40000000000 \
  > $OUT/serve.log 2>&1 &
PID=$!
for _ in $(seq 150); do curl -sf localhost:30000/health >/dev/null && break; sleep 0.5; done
echo "serve: /health OK $((SECONDS - T1)) s after start" | tee $OUT/summary.txt
timeout 170 k3compile bench serve --base-url http://127.0.0.1:30000 --dataset fixed --input-len 128 --output-len 128 \
  --max-concurrency 1,8,64 --num-prompts 4 --prompts-per-concurrency 1 --warmup-requests 1 \
  --engine-step $ENGINE --engine-device cuda --engine-memory-bytes 8000000000 \
  --label k3-mini-6b --out $OUT > $OUT/bench.log 2>&1
echo "bench serve: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/summary.txt
kill $PID; wait $PID 2>/dev/null
grep -E "memory:|warm-up" $OUT/serve.log | head -3 | tee -a $OUT/summary.txt
grep -v -i warn $OUT/bench.log | tail -12 | tee -a $OUT/summary.txt
python3 - $OUT/serve_k3-mini-6b.json <<'PY' | tee -a $OUT/summary.txt
import json, sys
d = json.load(open(sys.argv[1]))
w = d.get("warmup", [{}])[0].get("ttft_ms")
print(f"first request after /health: TTFT {w} ms")
for r in d["runs"]:
    print(f"c{r['max_concurrency']:>3}: ITL p50 {r['median_itl_ms']:.2f} ms, engine step {r.get('engine_step_ms')} ms, "
          f"ratio {r.get('itl_p50_over_engine_step')}; TTFT p50 {r['median_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f} ms "
          f"(p99 / single prefill {r.get('ttft_p99_over_single_prefill')}); {r['output_throughput']:.0f} tok/s")
c1 = next(r for r in d["runs"] if r["max_concurrency"] == 1)
print(f"first-request TTFT / warm TTFT p50 (c1): {w / c1['median_ttft_ms'] if w else None}")
print("engine:", json.dumps(d.get("engine_step", {}).get("batches")))
PY
echo "all done ($((SECONDS - T0)) s)"
