#!/usr/bin/env bash
# Session 19's device calls (issue 9), each < 10 min warm; carry .whl/. Session 17/18's arms, reordered so that the
# first H200 call brings what decides the 48B batch-1 goal:
#   PART=h200a (needs the H200's memory, ~480 s warm) the GPU tests changed since they last ran on a GPU (gpu_s17's
#              `one` list, TESTS_TL), the 48B ladder at batch 1 with v-rpf (T48), the 48B batch-1 attributed profile
#              (tools/profile_engine_step.py, PROF_TL) for `k3compile report` on CPU
#   PART=mini  (H100 or H200) as gpu_s18.sh's mini: GPU tests of tests/passes, k3-mini-6b batch 1 with v-front,
#              v-front8, v-rpf, then the k3-mini-6b attributed profile; then `chain` below
#   PART=chain (H100 or H200, ~150 s) the GEMV-chain kernel's GPU tests and tools/bench_gemv_chain.py (CHAIN_TL): what a
#              GEMV -> GEMV launch boundary costs against an in-kernel dependency (the megakernel question)
# Every part ends with `chain` when CHAIN=1 (the default for mini and h200a).
set -u
PART=${PART:-h200a}
source tools/gpu_setup.sh
mkdir -p $OUT/logs
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
chain() {
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/passes/kernels/test_gemv_chain.py \
    > $OUT/logs/tests_chain.log 2>&1
  say "gemv chain GPU tests: exit $?"; tail -2 $OUT/logs/tests_chain.log
  timeout ${CHAIN_TL:-120} python3 tools/bench_gemv_chain.py --rows ${CHAIN_ROWS:-1} --out $OUT/gemv_chain.md \
    > $OUT/logs/bench_chain.log 2>&1
  say "bench_gemv_chain: exit $?"; grep -E "^- " $OUT/gemv_chain.md
}
if [ "$PART" = chain ]; then chain; (cd $OUT && tar cf logs.tar logs && rm -rf logs); exit 0; fi
if [ "$PART" = mini ]; then
  PART=mini bash tools/gpu_s18.sh
  mkdir -p $OUT/logs; [ "${CHAIN:-1}" = 1 ] && chain
  (cd $OUT && tar rf logs.tar logs 2>/dev/null || tar cf logs.tar logs; rm -rf logs); exit 0
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a $OUT/call.log
timeout ${TESTS_TL:-120} python3 -m pytest -q -m gpu -n 4 --dist loadfile -p no:cacheprovider \
  tests/passes/kernels/test_moe_sorted.py tests/passes/test_p08_small_m_route_gemv.py \
  tests/passes/test_p07_norm_route.py "tests/passes/kernels/test_moe_decode.py::test_cuda_routed_l2_prefetch_gives_the_same_bits" \
  tests/passes/test_p06_fused_moe_decode.py -k "cuda" > $OUT/logs/tests.log 2>&1
say "changed GPU tests: exit $?"; tail -3 $OUT/logs/tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/tests.log | head -20
T=${T48:-150}
timeout $((T + 40)) k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1 --context 512 \
  --device cuda --quick --time-budget $T --variant "rpf:p06_fused_moe_decode.routed_l2_prefetch=true" --out $OUT/l \
  > $OUT/logs/ladder_48b1.log 2>&1
say "ladder 48b1: exit $?"
for f in $OUT/l/ladder_*.{md,json,png}; do [ -f "$f" ] && cp "$f" "$OUT/48b1_$(basename $f)"; done
grep -E "^\| (r04|r16|v-)|^- v-|^- batch" $OUT/l/ladder_*.md | head -12
rm -rf $OUT/l
timeout ${PROF_TL:-150} python3 tools/profile_engine_step.py --model kimi-linear-48b --dtype bf16 --batch 1 \
  --context 512 --out $OUT/profile_kimi-linear-48b_bs1.json.gz > $OUT/logs/profile_48b.log 2>&1
say "profile 48b: exit $?"; tail -3 $OUT/logs/profile_48b.log
[ "${CHAIN:-1}" = 1 ] && chain
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"; ls -la $OUT
