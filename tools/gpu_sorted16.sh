#!/usr/bin/env bash
# Session 16 (issue 9): the sorted M-tiled MoE experts (passes/kernels/moe_sorted.py, P6 option grouped_sorted) above
# P6's crossover. One H200 call, ~400 s warm:
#   1. GPU tests: tests/passes/kernels/test_moe_sorted.py (align exact, experts vs the fp32 loop at k3-mini-6b / 48B
#      expert shapes, CUDA-graph replay on new routing, the op with the latent tail) and P6's GPU tests
#   2. tools/bench_moe_sorted.py: one MoE layer per shape at batch 16-256, fused / grouped / sorted and the sorted
#      launch variants, from CUDA graphs -> sorted16.md
#   3. PART=mini (default): the k3-mini-6b ladder at batch 64 with the arm v-sorted (grouped_sorted=true), timed
#      interleaved with engine-after and gated by the pinned accuracy gate; PART=48b: the 48B ladder at batch 64 only
#      (skips 1 and 2)
#   run: bash tools/gpu_sorted16.sh  (carry .whl/);  PART=48b TL=300 bash tools/gpu_sorted16.sh
#   next A/B (sorted_finish, off by default): VARIANTS="finish:p06_fused_moe_decode.sorted_finish=true" bash ...
# Back in $OUT: sorted16.md / .json, ladder_*.{md,json,png}, call.log, logs.tar (tests.log, bench.log, ladder.log)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
mkdir -p $OUT/logs
PART=${PART:-mini}
# session 16 ran the arm v-sorted (grouped_sorted=true, the default since); VARIANTS (space-separated NAME:P.O=V,...)
# replaces it, e.g. VARIANTS="finish:p06_fused_moe_decode.sorted_finish=true" for the next A/B
V=(); for v in ${VARIANTS:-sorted:p06_fused_moe_decode.grouped_sorted=true}; do V+=(--variant "$v"); done
if [ "$PART" = mini ]; then
  run_gpu_tests ${TEST_EACH:-150} "tests/passes/kernels/test_moe_sorted.py::" "tests/passes/test_p06_fused_moe_decode.py::cuda"
  timeout ${BENCH_TL:-150} python3 tools/bench_moe_sorted.py $OUT ${BENCH_BATCHES:-16,32,64,128,256} > $OUT/logs/bench.log 2>&1
  say "bench: exit $?"; tail -14 $OUT/logs/bench.log
  MODEL=k3-mini-6b
else
  MODEL=kimi-linear-48b
fi
timeout $(( ${TL:-200} + 30 )) k3compile bench ladder --model $MODEL --dtype bf16 --batch ${BATCHES:-64} --context 512 \
  --device cuda --quick --time-budget ${TL:-200} "${V[@]}" --out $OUT/l > $OUT/logs/ladder.log 2>&1
say "ladder $MODEL: exit $?"
cp $OUT/l/ladder_*.json $OUT/l/ladder_*.md $OUT/l/ladder_*.png $OUT/ 2>/dev/null
grep -E "^\| (r[0-9]|v-|eager|arm)" $OUT/l/ladder_*.md | head -30; grep -E "crossover|sorted" $OUT/l/ladder_*.md | head -8
rm -rf $OUT/l
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"; ls -la $OUT
