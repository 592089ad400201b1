#!/usr/bin/env bash
# Session 4, last device round: parts chosen by PART, each one call (< 10 minutes), machine warm between them.
#   PART=ladder : the MoE dispatch + tile bench (tools/bench_moe_kernels.py), the AttnRes one-pass kernel bench
#                 (tools/bench_attn_res_norm.py), then `bench ladder --quick` at the Kimi-Linear-48B shape, batch 1 and 8
#                 (every rung; the accuracy gate per rung). No torch.compile / transformers anchors (device time).
#   PART=serve  : the GPU test suite on 4 xdist workers, timed; a k3-mini-6b engine with verify graphs; `serve` of it
#                 with default flags + tools/serve_check.py (issue 10) and the serve14 bench (issue 14).
#   PART=spec   : GPU bit-identity of the ReplaySSM fold vs P5, `profile verify`, `bench spec` (controlled
#                 acceptance, labelled), NCCL single-rank checks of the parallel code (tools/gpu_par16.sh parts).
#   run: PART=ladder bash tools/gpu_s4_final.sh   (carry .whl/)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
ENGINE=/tmp/engines/mini
case "${PART:-ladder}" in
ladder)
  timeout 70 python3 tools/bench_moe_kernels.py $OUT > $OUT/moe_bench.log 2>&1; say "moe bench: exit $?"
  grep -v '^{' $OUT/moe_bench.log | grep -v -i warn | tail -40
  timeout 55 python3 tools/bench_attn_res_norm.py --batch 1 8 64 --out $OUT/attn_res_norm.json 2>&1 \
    | grep -v -i warn > $OUT/attn_res_norm_bench.md; say "attn_res_norm bench: exit $?"; cat $OUT/attn_res_norm_bench.md | tail -30
  timeout ${T48:-330} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8 --context 512 \
    --device cuda --quick --time-budget $(( ${T48:-330} - 30 )) --out $R/ladder48 > $OUT/ladder48.log 2>&1
  say "ladder 48B: exit $?"
  cp $R/ladder48/ladder_*.json $R/ladder48/ladder_*.md $R/ladder48/ladder_*.png $OUT/ 2>/dev/null
  (cd $R/ladder48 && tar cf $OUT/ladder48_traces.tar traces 2>/dev/null); rm -rf $R
  grep -A30 "^| arm |" $OUT/ladder_*.md | head -60
  ;;
serve)
  T1=$SECONDS
  timeout ${SUITE_LIMIT:-240} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -o faulthandler_timeout=200 \
    --durations=30 -rs tests > $OUT/gpu_tests.log 2>&1
  echo "gpu tests: exit $?, $((SECONDS - T1)) s wall" | tee -a $OUT/gpu_tests.log
  grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -20
  timeout 170 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
    --verify-graphs > $OUT/build.log 2>&1; say "build: exit $?"
  grep -E "verify:|error|Error" $OUT/build.log | tail -8
  [ -f tools/gpu_serve14_body.sh ] && source tools/gpu_serve14_body.sh
  ;;
spec)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/runtime/spec/test_fold_gpu.py 2>&1 | tail -15 > $OUT/fold_gpu.txt
  cat $OUT/fold_gpu.txt; say "fold test done"
  [ -f $ENGINE/engine.json ] || { timeout 170 k3compile build --model k3-mini-6b --topology single --dtype bf16 \
    --device cuda -o $ENGINE --overwrite --verify-graphs > $OUT/build.log 2>&1; say "build: exit $?"; }
  timeout 100 k3compile profile verify --engine $ENGINE --device cuda --batch 1,8,64,256 --tokens 5 \
    --context 512 --steps 10 --warmup 3 --out $OUT/profiles > $OUT/profile.log 2>&1
  say "profile: exit $?"; grep -v -i warn $OUT/profile.log | tail -24
  PROF=$(ls $OUT/profiles/*.json 2>/dev/null | head -1)
  timeout 150 k3compile bench spec --engine $ENGINE --device cuda --batch 1,8,64,256 --gamma 4 \
    --proposer controlled --accept-p 0.7 ${PROF:+--profile $PROF} --prompt-len 64 --max-new-tokens 32 \
    --memory-gib 24 --out $R/spec > $OUT/spec.log 2>&1
  say "bench spec: exit $?"
  cp $R/spec/spec_*.json $R/spec/spec_*.md $OUT/ 2>/dev/null; rm -rf $R
  grep -v -i warn $OUT/spec.log | tail -30
  [ -f tools/gpu_par16_body.sh ] && source tools/gpu_par16_body.sh
  ;;
esac
say "all done"
