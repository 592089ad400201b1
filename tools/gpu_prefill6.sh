#!/usr/bin/env bash
# prefill6 on the H200, one device call (<= 4 min when /tmp/engines/mini exists; + up to 4 min to build it):
# does a prefill step batch? Time vs number of requests at fixed tokens, on the executor path `serve` uses.
#   run: bash tools/gpu_prefill6.sh   (carry .whl/: fla-core, see tools/gpu_setup.sh)
# 1. builds k3-mini-6b (bf16) into /tmp/engines/mini only if engine.json is missing;
# 2. the batched prefill ops against the CPU reference (tests/model_def/test_gpu.py, prefill ops only);
# 3. tools/prefill_scaling.py: the engine's prefill step at 1x128, 8x128, 64x128, 1x8192 and 8x1024 (first call
#    and warm median; look at "ms/1k tok": flat or falling with B = the step batches), a torch.profiler view of
#    one warm 64x128 step (kernel launches, host reads/syncs, top ops by device time), and the serve path
#    (LLMEngine, unified memory, --max-batch-tokens 8192): 1x128 vs 64x128 prompts to their first tokens.
# Back in $OUT: summary.txt (the tables), prefill_scaling.json, gpu_tests.txt, build.log if built.
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/summary.txt; }
if [ -f $ENGINE/engine.json ]; then say "engine: reusing $ENGINE"; else
  timeout 240 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
    > $OUT/build.log 2>&1; say "build: exit $?"; fi
[ -f $ENGINE/engine.json ] || { tail -20 $OUT/build.log; exit 1; }
timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/model_def/test_gpu.py \
  -k "prefill_op or short_conv or batched_prefill or prefill_logits" > $OUT/gpu_tests.txt 2>&1
say "gpu prefill op tests: exit $? ($(tail -1 $OUT/gpu_tests.txt))"
grep "^\[gpu\]" $OUT/gpu_tests.txt | tee -a $OUT/summary.txt
timeout 170 python3 tools/prefill_scaling.py --engine $ENGINE --device cuda --warm 2 \
  --shapes ${SHAPES:-1x128,8x128,64x128,8x1024,1x8192} --profile 64x128 --serve-shapes ${SERVE_SHAPES:-1x128,64x128} \
  --max-batch-tokens 8192 --memory-bytes 40000000000 --json $OUT/prefill_scaling.json \
  2> $OUT/prefill_scaling.log | tee -a $OUT/summary.txt
say "prefill_scaling: exit ${PIPESTATUS[0]}"
tail -5 $OUT/prefill_scaling.log
say "all done"
