#!/usr/bin/env bash
# Second H200 call: the torch.compile baseline (reduce-overhead) at batch 1 next to eager and the engine,
# then an fp32 numerics check of the graph arms at batch 8.
source tools/gpu_setup.sh
timeout 330 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --steps 40 --reps 5 --warmup 20 \
  --arms eager,engine,compile-reduce-overhead --compile-static --time-budget 300 --out $R/decode_c 2>&1 | grep -v Warning | tail -22
cp $R/decode_c/*.md $OUT/decode_c.md 2>/dev/null; cp $R/decode_c/*.json $OUT/decode_c.json 2>/dev/null
timeout 110 k3compile bench decode --model k3-mini-6b --dtype fp32 --batch 8 --context 512 --steps 5 --reps 1 --warmup 2 \
  --arms eager,graphs,engine --out $R/decode_fp32 2>&1 | grep -E "^\| (eager|graphs|engine)" 
cp $R/decode_fp32/*.md $OUT/decode_fp32.md 2>/dev/null
