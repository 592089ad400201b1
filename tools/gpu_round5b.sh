#!/usr/bin/env bash
# Fifth H200 session, call B (run right after call A, on the same warm machine): the max-autotune arm next to
# eager and the engine at batch 1, loading what call A's killed compile left in the kept Inductor cache.
# (The all-arms run planned here did not fit the device budget after call A; see the closing note.)
source tools/gpu_setup.sh
export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor_cache/inductor TRITON_CACHE_DIR=$PWD/.inductor_cache/triton
du -sh .inductor_cache
timeout 490 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --steps 40 --reps 5 --warmup 20 \
  --arms eager,engine,compile-max-autotune --compile-static --time-budget 470 --out $R/decode_f 2>&1 \
  | grep -v -i warn | grep -E "^\[|failed|Error|\|" | tail -30
cp $R/decode_f/*.md $OUT/decode_f.md; cp $R/decode_f/*.json $OUT/decode_f.json
k3compile report $R/decode_f/traces/decode_k3-mini-6b_bf16_compile-max-autotune_bs1.json.gz --top 12 \
  > $OUT/report_max_autotune_bs1.txt 2>&1
# then the runtime GPU tests (Triton cache warm by now):
#   timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/runtime/test_engine_gpu.py tests/runtime/test_executor.py
#   python3 tools/diag_engine_cuda.py cuda
