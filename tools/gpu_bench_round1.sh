#!/usr/bin/env bash
# One H200 session: decode baseline (issue 3) and compaction move cost (issue 5), results into $OUT.
source tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -c "import k3compile.model_def.ops.library as l; from k3compile.model_def.ops.cuda_backend import BACKENDS; print(BACKENDS)"
timeout 100 k3compile bench compaction --model k3-mini-6b --dtype bf16 --batch 8 --context 512 --out $R/compaction 2>&1 | tail -15
cp $R/compaction/compaction.md $OUT/ 2>/dev/null
timeout 230 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1,8,64 --context 512 --steps 40 --reps 5 --warmup 20 \
  --arms eager,graphs,engine --time-budget 200 --out $R/decode_a 2>&1 | tail -30
cp $R/decode_a/*.md $OUT/decode_a.md 2>/dev/null
timeout 250 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --steps 40 --reps 5 --warmup 20 \
  --arms eager,engine,compile-reduce-overhead,compile-max-autotune --bounded-autotune --time-budget 220 --out $R/decode_b 2>&1 | tail -30
cp $R/decode_b/*.md $OUT/decode_b.md 2>/dev/null
tar czf $OUT/results.tgz -C $R . 2>/dev/null; ls -la $OUT
