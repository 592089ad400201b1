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
# bench.log, summary.txt; first, serve with default flags + tools/serve_check.py (issue 10): serve_default.log,
# serve_check.txt.
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/build.log
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/build.log; exit 1; }
source tools/gpu_serve14_body.sh
echo "all done ($((SECONDS - T0)) s)"
