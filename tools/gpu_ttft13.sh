#!/usr/bin/env bash
# Session 13, helper ttft13: what a served k3-mini-6b first token is made of (traces/h200_s13/call3: TTFT p50 643 ms
# for a new 448-token prompt = 3 prefill forwards of 256 + 176 + 16 tokens, 225 ms for its repeat = 1 forward of 16:
# ~200 ms per prefill forward whatever its size). One device call:
#   1. `k3compile build` of the default engine (k3-mini-6b bf16, random weights, seed 0), as gpu_serve13.sh.
#   2. tools/diag_ttft13.py ENGINE (in-process, serve's EngineArgs: --memory-bytes 40e9 --step-timing, decode graph
#      bucket 1 only): TTFT of 4 new 448-token prompts one at a time and of their repeats, per prefill forward its
#      tokens, host ms (the launching call) and device ms (CUDA events); chunk_size 2048 (serve --chunk-size 2048:
#      2 forwards instead of 3); one 256-token and one 16-token prefill forward under torch.profiler (host ops, aten
#      ops, kernels, k3:: custom ops' CPU ms) and their host syncs (torch.cuda.set_sync_debug_mode); then the prefill
#      graph recaptured from the same preset/seed and swapped in, with pass p18_short_conv_merge off and on (off by
#      default): TTFT, host/device ms per forward, host ops, and the first 8 tokens of a fixed prompt (must match).
#   3. if time is left: `serve ENGINE --step-timing` + `bench serve --client openai` at concurrency 1 (4 prompts of
#      448 tokens, 16 output) and the same prompts again: the served TTFT next to the server's own prefill figures
#      (server_prefill: prefill forwards per first token, tokens / host ms / device ms per forward, engine-side TTFT).
#   run: bash tools/gpu_ttft13.sh   (carry .whl/ as for gpu_serve13.sh: the server wheels, fla-core, openai's)
# Expected wall after set-up: build ~90 s (s13: 87 s), diag ~150-190 s (engine load ~40 s, first prefill kernels'
# compile/autotune ~30-60 s, the rest ~80 s) = ~240-280 s; the served part (~60-90 s with warm Triton caches) runs
# only when BUDGET leaves >= 110 s (BUDGET=300 by default, seconds from the script's start; BUDGET=420 with a
# 600 s call timeout to include it).
# CPU dry run (k3-tiny, no GPU): DEVICE=cpu MODEL=k3-tiny DTYPE=fp32 MEM=67108864 OUT=/tmp/ttft13_dry \
#   PATH=.venv/bin:$PATH bash tools/gpu_ttft13.sh
# Back in $OUT (<= 5 files): summary.txt, engine.json, ttft.json (the diag's figures), serve_ttft.json (bench serve,
# if run), logs.tgz (build, diag, serve, bench logs; the diag's torch.profiler tables profile_*.txt)
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  source tools/gpu_setup.sh
else   # the CPU dry run: the caller's Python environment
  set -u; OUT=${OUT:-/tmp/ttft13_dry}; rm -rf $OUT; mkdir -p $OUT
fi
MODEL=${MODEL:-k3-mini-6b}; DTYPE=${DTYPE:-bf16}; ENGINE=${ENGINE:-/tmp/engines/ttft13}
MEM=${MEM:-40000000000}; PORT=${PORT:-30000}; BUDGET=${BUDGET:-300}
T0=0
mkdir -p $OUT/logs
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/summary.txt; }
left() { echo $((BUDGET - (SECONDS - T0))); }
URL=http://127.0.0.1:$PORT

timeout 200 k3compile build --model $MODEL --dtype $DTYPE --device $DEVICE -o $ENGINE --overwrite \
  > $OUT/logs/build.log 2>&1
say "build ($MODEL $DTYPE, default pipeline): exit $?"
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/logs/build.log; exit 1; }
cp $ENGINE/engine.json $OUT/engine.json

# 2. the in-process breakdown (writes ttft.json after each part: a time-out keeps what was done)
mkdir -p $OUT/logs/diag
DIAG_T=$(( $(left) - 10 )); [ $DIAG_T -lt 60 ] && DIAG_T=60
timeout $DIAG_T python3 tools/diag_ttft13.py $ENGINE $OUT/logs/diag $MEM > $OUT/logs/diag.log 2>&1
say "diag_ttft13: exit $? (limit $DIAG_T s)"
grep -v -e USDT -e Warning -e warn $OUT/logs/diag.log | grep "^\[" | cut -c1-400 | tee -a $OUT/summary.txt
[ -f $OUT/logs/diag/ttft.json ] && mv $OUT/logs/diag/ttft.json $OUT/ttft.json

# 3. the served TTFT with the server's prefill figures (Triton caches are warm by now)
if [ $(left) -ge 110 ]; then
  CLIENT=openai
  python3 -c "import openai" 2>/dev/null || CLIENT=sse
  t1=$SECONDS
  k3compile serve $ENGINE --device $DEVICE --port $PORT --memory-bytes $MEM --step-timing \
    > $OUT/logs/serve.log 2>&1 &
  SERVER_PID=$!
  for _ in $(seq $(( $(left) - 40 ))); do
    curl -sf $URL/health >/dev/null && break
    kill -0 $SERVER_PID 2>/dev/null || break
    sleep 1
  done
  if curl -sf $URL/health >/dev/null; then
    say "serve: /health OK $((SECONDS - t1)) s after start"
    timeout $(( $(left) > 60 ? $(left) - 10 : 50 )) k3compile bench serve --client $CLIENT --base-url $URL \
      --dataset fixed --input-len 448 --output-len 16 --max-concurrency 1 --num-prompts 4 --warmup-requests 1 \
      --repeat-first-run --label ttft13 --out $OUT > $OUT/logs/bench.log 2>&1
    say "bench serve ($CLIENT client): exit $?"
    grep -v -i warn $OUT/logs/bench.log | grep "ok," | cut -c1-400 | tee -a $OUT/summary.txt
  else
    say "serve: not healthy after $((SECONDS - t1)) s"; tail -5 $OUT/logs/serve.log
  fi
  kill $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null
  for f in $OUT/serve_*.json; do [ -f "$f" ] && mv "$f" $OUT/serve_ttft.json; done
  mv $OUT/serve_*.png $OUT/logs/ 2>/dev/null
else say "served run: skipped ($(left) s left of BUDGET=$BUDGET)"; fi

tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
rmdir $OUT/r 2>/dev/null   # gpu_setup.sh's results folder, unused here
say "all done"
