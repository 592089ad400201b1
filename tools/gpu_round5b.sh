#!/usr/bin/env bash
# Fifth H200 session, call B: every decode arm of issue 3 in one run at batch 1 (the Inductor arms load what
# call A compiled), BENCHMARKS.md protocol: 20 warm-up steps, 5 interleaved reps x 200 steps.
source tools/gpu_setup.sh
export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor_cache/inductor TRITON_CACHE_DIR=$PWD/.inductor_cache/triton
du -sh .inductor_cache 2>/dev/null || echo "no compile cache: compiling from scratch"
timeout 570 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --steps 200 --reps 5 --warmup 20 \
  --arms eager,compile-reduce-overhead,graphs,engine,engine-inductor,compile-max-autotune --compile-static \
  --time-budget 520 --out $R/decode_e 2>&1 | grep -v -i warn | grep -E "^\[|failed|Error|\|" | tail -40
cp $R/decode_e/*.md $OUT/decode_e.md; cp $R/decode_e/*.json $OUT/decode_e.json
for a in compile-max-autotune compile-reduce-overhead engine-inductor; do
  k3compile report $R/decode_e/traces/decode_k3-mini-6b_bf16_${a}_bs1.json.gz --top 12 > $OUT/report_${a}_bs1.txt 2>&1
done
