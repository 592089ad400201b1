#!/usr/bin/env bash
# Issue 14 on the H200, one device call (~8 min): the issue's table re-measured after serve5's fixes.
#   run: bash tools/gpu_serve15.sh   (carry .whl/: fla-core and the server wheels, see tools/gpu_setup.sh)
# serve5 found (traces/serve_cpu/README.md) that the s4 table's "bursts" (ITL p50 263 ms, TTFT = E2E) were
# the server sending no chunk for tokens without text -- a random k3-mini-6b emits ids >= 256, which the
# byte tokenizer renders as nothing -- so everything streamed at the end. Fixed: a chunk per step. This
# re-measures, with the s4 flags (unified memory, 40 GB pools, default overlap/mixed/warm-up):
# 1. build k3-mini-6b (bf16);
# 2. serve on the engine thread (the default) + `bench serve` at concurrency 1, 8, 64 (4, 8, 64 requests,
#    128-token prompts, 128 output tokens) with --engine-step (the engine's own step, in the bench process):
#    serve_thread.json;
# 3. the same with `serve --engine-process` (engine in a child process: no GIL shared with the HTTP side):
#    serve_process.json (ratios against step 2's engine step in summary.txt);
# 4. concurrency 64 with --max-batch-tokens 8192 (the 64 prompts in ~2 prefill steps instead of ~5):
#    serve_budget8192.json;
# 5. the CPU stand-in (`bench serve --stand-in 2.5,0.125`, H200-like step times, no GPU) on this host's
#    CPU, thread vs process: serve_cpu_thread.json, serve_cpu_process.json -- what serving adds on a
#    fast uncontended host.
# Back in $OUT: summary.txt (look at: ITL p50 / engine step per concurrency, chunks per token ~1.0,
# TTFT p99 / single prefill and / the engine's own prefill of the same 64 prompts, first-request TTFT),
# build.log, serve_*.log, bench_*.log, the JSONs and PNGs.
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/summary.txt; }
[ -f $ENGINE/engine.json ] && say "engine: reusing $ENGINE" || {
  timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
    > $OUT/build.log 2>&1; say "build: exit $?"; }
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/build.log; exit 1; }

python3 -c "import uvloop" 2>/dev/null && say "uvloop: yes (uvicorn runs on libuv)" \
  || say "uvloop: no (asyncio's loop; put a uvloop wheel for this Python in .whl/ to use it)"
FLAGS="--device cuda --port 30000 --enable-unified-memory --memory-bytes 40000000000"
BENCH="--base-url http://127.0.0.1:30000 --dataset fixed --input-len 128 --output-len 128 --num-prompts 4 \
  --prompts-per-concurrency 1 --warmup-requests 1 --out $OUT"
left() { echo $((${SERVE_BUDGET:-570} - (SECONDS - T0))); }   # the device call's 600 s, less a margin for the summary
serve_bench() {   # LABEL LIMIT_S "SERVE FLAGS" BENCH FLAGS...
  local label=$1 limit=$2 sflags=$3; shift 3
  [ $(left) -gt $((limit + 40)) ] || { say "$label: skipped ($(left) s left)"; return; }
  local t1=$SECONDS
  k3compile serve $ENGINE $FLAGS $sflags > $OUT/serve_$label.log 2>&1 &
  local pid=$!
  for _ in $(seq 180); do curl -sf localhost:30000/health >/dev/null && break; sleep 0.5; done
  say "$label: /health OK $((SECONDS - t1)) s after start ($(grep -o 'warm-up took [0-9.]* s' $OUT/serve_$label.log))"
  timeout $limit k3compile bench serve $BENCH --label $label "$@" > $OUT/bench_$label.log 2>&1
  say "$label: bench exit $?"
  kill $pid; wait $pid 2>/dev/null
  grep -v -i warn $OUT/bench_$label.log | grep "ok," | tee -a $OUT/summary.txt
}
serve_bench thread 200 "" --max-concurrency 1,8,64 --engine-step $ENGINE --engine-device cuda \
  --engine-memory-bytes 8000000000
serve_bench process 120 "--engine-process" --max-concurrency 1,8,64
serve_bench budget8192 60 "--max-batch-tokens 8192" --max-concurrency 64
for mode in thread process; do
  [ $(left) -gt 100 ] || { say "cpu stand-in ($mode): skipped ($(left) s left)"; continue; }
  extra=""; [ $mode = process ] && extra="--stand-in-server-flags=--engine-process"
  timeout 100 k3compile bench serve --stand-in 2.5,0.125 $extra --dataset fixed --input-len 128 --output-len 128 \
    --max-concurrency 1,8,64 --num-prompts 4 --prompts-per-concurrency 1 --label cpu_$mode --out $OUT \
    > $OUT/bench_cpu_$mode.log 2>&1
  say "cpu stand-in ($mode): exit $?"
done

files=$(for l in thread process budget8192 cpu_thread cpu_process; do [ -f $OUT/serve_$l.json ] && echo $OUT/serve_$l.json; done)
steps=""; [ -f $OUT/serve_thread.json ] && steps="--steps-from $OUT/serve_thread.json"   # process, budget8192: step 2's engine
[ -n "$files" ] && python3 -m k3compile.bench.serve_table $files $steps | tee -a $OUT/summary.txt
[ -f $OUT/serve_thread.json ] && python3 -c "import json,sys; print('engine:', json.dumps(json.load(open(sys.argv[1]))['engine_step']['batches']))" \
  $OUT/serve_thread.json | tee -a $OUT/summary.txt
say "all done"
