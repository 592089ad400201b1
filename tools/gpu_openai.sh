#!/usr/bin/env bash
# Issue 12 on the H200: n=8 forked vs 8 separate requests (k3-mini-6b bf16, split pools and unified
# arena), then the GPU sampler test. Results: $OUT/fork_split.jsonl, $OUT/fork_unified.jsonl (one JSON
# line per arm + a ratio line), $OUT/gpu_sampler.log.
source tools/gpu_setup.sh
for mode in split unified; do
  flag=""; [ $mode = unified ] && flag="--unified"
  timeout 240 python3 tools/bench_fork.py --model k3-mini-6b --device cuda --dtype bf16 --n 8 --prompt-len 1000 \
    --max-new 32 --memory-bytes 16000000000 $flag 2>&1 | grep -v -i warn | tee $OUT/fork_$mode.jsonl
done
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_sampler.py 2>&1 | tail -5 | tee $OUT/gpu_sampler.log
