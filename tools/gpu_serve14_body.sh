# Sourced by tools/gpu_serve14.sh and tools/gpu_s4_final.sh (PART=serve) once $ENGINE is built (they define say): issue 10's default-flags serve check, then
# issue 14's served-vs-engine bench (the issue table's flags: unified memory, 40 GB), as tools/gpu_serve14.sh does.
T1=$SECONDS
k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve_default.log 2>&1 &
PID=$!
for _ in $(seq 240); do curl -sf localhost:30000/health >/dev/null && break; sleep 0.5; done
say "serve (default flags): /health OK $((SECONDS - T1)) s after start"
timeout 90 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1; say "serve_check: exit $?"
kill $PID; wait $PID 2>/dev/null
grep -E "memory:|warm-up" $OUT/serve_default.log | head -3; cat $OUT/serve_check.txt
T1=$SECONDS
k3compile serve $ENGINE --device cuda --port 30000 --enable-unified-memory --memory-bytes 40000000000 \
  > $OUT/serve.log 2>&1 &
PID=$!
for _ in $(seq 240); do curl -sf localhost:30000/health >/dev/null && break; sleep 0.5; done
echo "serve: /health OK $((SECONDS - T1)) s after start" | tee $OUT/summary.txt
timeout ${BENCH_LIMIT:-170} k3compile bench serve --base-url http://127.0.0.1:30000 --dataset fixed --input-len 128 \
  --output-len 128 --max-concurrency 1,8,64 --num-prompts 4 --prompts-per-concurrency 1 --warmup-requests 1 \
  --engine-step $ENGINE --engine-device cuda --engine-memory-bytes 8000000000 \
  --label k3-mini-6b --out $OUT > $OUT/bench.log 2>&1
echo "bench serve: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/summary.txt
kill $PID; wait $PID 2>/dev/null
grep -E "memory:|warm-up" $OUT/serve.log | head -3 | tee -a $OUT/summary.txt
grep -v -i warn $OUT/bench.log | tail -12 | tee -a $OUT/summary.txt
[ -f $OUT/serve_k3-mini-6b.json ] && python3 - $OUT/serve_k3-mini-6b.json <<'PY' | tee -a $OUT/summary.txt
import json, sys
d = json.load(open(sys.argv[1]))
w = d.get("warmup", [{}])[0].get("ttft_ms")
print(f"first request after /health: TTFT {w} ms")
for r in d["runs"]:
    print(f"c{r['max_concurrency']:>3}: ITL p50 {r['median_itl_ms']} ms, engine step {r.get('engine_step_ms')} ms, "
          f"ratio {r.get('itl_p50_over_engine_step')}; TTFT p50 {r['median_ttft_ms']} p99 {r['p99_ttft_ms']} ms "
          f"(p99 / single prefill {r.get('ttft_p99_over_single_prefill')}); {r['output_throughput']:.0f} tok/s")
c1 = next(r for r in d["runs"] if r["max_concurrency"] == 1)
print(f"first-request TTFT / warm TTFT p50 (c1): {w / c1['median_ttft_ms'] if w else None}")
print("engine:", json.dumps(d.get("engine_step", {}).get("batches")))
PY
