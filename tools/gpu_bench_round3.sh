#!/usr/bin/env bash
# Third H200 call: the engine's post-pass decode graph through Inductor (then CUDA graphs) next to eager,
# the plain engine and torch.compile(reduce-overhead), batch 1.
source tools/gpu_setup.sh
timeout 250 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --steps 40 --reps 5 --warmup 20 \
  --arms eager,engine,engine-inductor,compile-reduce-overhead --compile-static --time-budget 230 --out $R/decode_d 2>&1 | grep -v -i warn | tail -16
cp $R/decode_d/*.md $OUT/decode_d.md 2>/dev/null; cp $R/decode_d/*.json $OUT/decode_d.json 2>/dev/null
