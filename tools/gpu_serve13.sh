#!/usr/bin/env bash
# Session 13, helper serve13 (issue 9 Deliver 2: "the fast path is the served path"), one device call:
#   1. `k3compile build` of the default engine (the ladder's last rung, engine-after: tests/k3compile/engine/
#      test_served_graph.py): k3-mini-6b bf16, random weights. Not the 48B shape: its engine is 98.2 GB of weights
#      (`k3compile info`), which an engine directory stores in full (weights.safetensors), more than this machine's
#      64 GB disk; the ladder measured k3-mini-6b as well (traces/h200_s12, call 4).
#   2. `serve ENGINE` (split pools, prefix cache on: the defaults) with --step-timing, driven by the official openai
#      client through `bench serve --client openai`: concurrency 1 (4 requests) and 8 (8 requests), fixed 448-token
#      prompts, 128 output tokens, greedy, then the first run's prompts again (--repeat-first-run: prefix-cache
#      hits). Per run: ITL / TPOT / TTFT, output tok/s, cached prompt tokens, and the server's own decode forward
#      time per batch bucket (/metrics before and after the run). serve_split.json
#   3. `bench decode --engine ENGINE --arms engine,engine-served --batch 1,8 --context 512` (eager is added as the
#      reference): the same engine's step the way the ladder times it (an executor with the bucket of its batch,
#      page-table capacity 512), and behind the executor `serve` makes (every bucket, capacity = the served default
#      context 32768: the MLA decode kernel's split count follows the capacity), interleaved in one run.
#   4. the same as 2 with --enable-unified-memory; `generate --engine` runs once meanwhile (in the background while
#      that server loads and warms up, finished before its requests start). serve_unified.json, logs/generate.log
#   5. summary.txt (tools/serve13_summary.py): served ITL p50 at c=1 / bench step at batch 1, server forward /
#      bench step, engine-served / engine, tok/s at c=8, cached tokens on the repeat, unified / split.
#   run: bash tools/gpu_serve13.sh   (carry .whl/: the server wheels, fla-core and the openai client's: openai,
#        httpx2, httpcore2, jiter, sniffio, truststore, anyio, h11, idna; see the report of serve13)
# Expected wall after set-up (session 11's k3-mini figures: build 64 s, first engine start 92 s + warm-up 113 s
# with cold Triton caches): build ~65 s, serve split ~210 s to /health + ~15 s of requests, bench decode ~70 s,
# serve unified ~70-100 s to /health (warm Triton cache; generate alongside) + ~15 s; total ~430-470 s. Each part
# is skipped, with a line saying so, when less than its need is left of BUDGET (default 560 s from the script's
# start, set-up included: give the call timeout_s 600).
# CPU dry run (k3-tiny, no GPU): DEVICE=cpu MODEL=k3-tiny DTYPE=fp32 IN=40 OUTLEN=8 CTX=48 MEM=67108864 \
#   OUT=/tmp/serve13_dry PATH=.venv/bin:$PATH bash tools/gpu_serve13.sh
# Back in $OUT (7 files): summary.txt, engine.json, serve_split.json, serve_unified.json, decode/decode_*.{json,md},
# logs.tgz (build, serve_*, bench_*, decode, generate logs; the bench serve PNGs)
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  source tools/gpu_setup.sh
else   # the CPU dry run: the caller's Python environment
  set -u; OUT=${OUT:-/tmp/serve13_dry}; rm -rf $OUT; mkdir -p $OUT
fi
MODEL=${MODEL:-k3-mini-6b}; DTYPE=${DTYPE:-bf16}; ENGINE=${ENGINE:-/tmp/engines/serve13}
IN=${IN:-448}; OUTLEN=${OUTLEN:-128}; CTX=${CTX:-512}; MEM=${MEM:-40000000000}; PORT=${PORT:-30000}
BUDGET=${BUDGET:-560}   # seconds from the script's start (the wheels' set-up included)
T0=0
mkdir -p $OUT/logs
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/summary.txt; }
left() { echo $((BUDGET - (SECONDS - T0))); }
URL=http://127.0.0.1:$PORT
CLIENT=openai
python3 -c "import openai" 2>/dev/null || { CLIENT=sse; say "openai client: not importable (carry its wheels in .whl/); \
the built-in client drives the servers instead"; }

timeout 240 k3compile build --model $MODEL --dtype $DTYPE --device $DEVICE -o $ENGINE --overwrite \
  > $OUT/logs/build.log 2>&1
say "build ($MODEL $DTYPE, default pipeline): exit $?"
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/logs/build.log; exit 1; }
cp $ENGINE/engine.json $OUT/engine.json

start_server() {   # LABEL FLAGS...: start `serve ENGINE` and wait for /health; sets SERVER_PID
  local label=$1; shift
  local t1=$SECONDS
  k3compile serve $ENGINE --device $DEVICE --port $PORT --memory-bytes $MEM --step-timing "$@" \
    > $OUT/logs/serve_$label.log 2>&1 &
  SERVER_PID=$!
  local wait_s=$(( $(left) - 40 )); [ $wait_s -gt 330 ] && wait_s=330
  for _ in $(seq $wait_s); do
    curl -sf $URL/health >/dev/null && break
    kill -0 $SERVER_PID 2>/dev/null || break
    sleep 1
  done
  if ! curl -sf $URL/health >/dev/null; then
    say "serve ($label): not healthy after $((SECONDS - t1)) s"; tail -5 $OUT/logs/serve_$label.log
    stop_server; return 1
  fi
  say "serve ($label): /health OK $((SECONDS - t1)) s after start ($(grep -o 'warm-up took [0-9.]* s' \
    $OUT/logs/serve_$label.log | head -1)); $(grep -o 'memory: .*' $OUT/logs/serve_$label.log | head -1 | cut -c1-220)"
}
stop_server() { kill $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null; }
drive() {   # LABEL: the openai client at concurrency 1 and 8, then the first run's prompts again
  timeout 150 k3compile bench serve --client $CLIENT --base-url $URL --dataset fixed --input-len $IN \
    --output-len $OUTLEN --max-concurrency 1,8 --num-prompts 4 --prompts-per-concurrency 1 --warmup-requests 1 \
    --repeat-first-run --label $1 --out $OUT > $OUT/logs/bench_$1.log 2>&1
  say "bench serve ($1): exit $?"
  grep -v -i warn $OUT/logs/bench_$1.log | grep "ok," | cut -c1-250 | tee -a $OUT/summary.txt
}

# 2. the defaults: split pools, prefix cache
if [ $(left) -gt 200 ]; then
  start_server split && { drive split; stop_server; }
else say "serve (split): skipped ($(left) s left)"; fi

# 3. the same engine's step as the ladder times it, and behind serve's executor
if [ $(left) -gt 110 ]; then
  timeout $(( $(left) > 170 ? 150 : $(left) - 20 )) k3compile bench decode --engine $ENGINE \
    --arms engine,engine-served --batch 1,8 --context $CTX --dtype $DTYPE --device $DEVICE --steps 40 --reps 5 --warmup 20 \
    --max-rep-seconds 0.5 --time-budget 110 --out $OUT/decode > $OUT/logs/decode.log 2>&1
  say "bench decode: exit $?"
  rm -rf $OUT/decode/traces
  grep -E "^\| (arm|eager|engine)" $OUT/decode/decode_*.md 2>/dev/null | cut -c1-160 | tee -a $OUT/summary.txt
else say "bench decode: skipped ($(left) s left)"; fi

# 4. unified memory; generate --engine alongside its start-up
if [ $(left) -gt 90 ]; then
  GT=$(( $(left) - 80 )); [ $GT -gt 200 ] && GT=200   # it must not hold up the unified server's requests for long
  ( t=$SECONDS; timeout $GT k3compile generate --engine $ENGINE --device $DEVICE --max-new-tokens 32 --show-ids \
      --prompt "The fast path is the served path:" > $OUT/logs/generate.log 2>&1
    echo "exit $? after $((SECONDS - t)) s" >> $OUT/logs/generate.log ) &
  GEN_PID=$!
  start_server unified --enable-unified-memory && {
    wait $GEN_PID; say "generate --engine (during the unified server's start): $(tail -1 $OUT/logs/generate.log)"
    drive unified; stop_server; }
  wait $GEN_PID 2>/dev/null
else say "serve (unified) and generate: skipped ($(left) s left)"; fi
[ -f $OUT/logs/generate.log ] && grep -a -E "^ids:|^exit" $OUT/logs/generate.log | cut -c1-300 | tee -a $OUT/summary.txt

python3 tools/serve13_summary.py $OUT | tee -a $OUT/summary.txt
mv $OUT/serve_*.png $OUT/logs/ 2>/dev/null
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
rmdir $OUT/r 2>/dev/null   # gpu_setup.sh's results folder, unused here
say "all done"
