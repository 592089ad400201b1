#!/usr/bin/env bash
# The open issues' H200 runs, one device call per JOBS list, the jobs one after the other:
#   suite      the GPU test suite, timed (issue 10; holds the NCCL world-1 P9/P12 tests of issue 16)
#   spec       build k3-mini-6b with verify graphs, ReplaySSM fold bit-identity on the GPU, `profile verify`,
#              `bench spec` with controlled acceptance (issue 13)
#   servecheck `serve` of that engine with default flags + tools/serve_check.py (issue 10)
#   serve      tools/gpu_serve15.sh, the served-path table (issue 14), reusing the engine
#   ladder     tools/gpu_ladder3.sh, the decode ladder with its anchors (issue 9)
#   kda        the KDA kernels' GPU tests (P5, verify inputs, ReplaySSM fold)
#   gate       bench ladder at k3-mini-6b batch 1 with the pinned-routing accuracy gate and its probes (issue 9)
#   prefill    tools/gpu_prefill6.sh: batched prefill ops vs CPU on the GPU, prefill time vs requests (issue 14)
#   twogpu     the two-GPU parallel engine test (issue 16; needs nvidia-h200-x2)
#   gemv       tools/bench_gemv.py (P8's candidates vs cuBLAS at 48B shapes) + P8's GPU tests (issue 9)
#   moe7       tools/gpu_moe7.sh; route7: tools/gpu_route7.sh; route8: tools/gpu_route8.sh (issue 9 kernels)
#   moe8       tools/gpu_moe8.sh: the shared gate/up GEMM in MoE kernel A, today vs new, PDL off/on (issue 9)
#   kda8       tools/gpu_kda8.sh; mla8: P15's W_UV merge kernel + the pipeline's GPU tests (issue 9)
#   p16        tools/gpu_p16.sh: P16's verify-graph bit-identity and its P16-off control (issue 13)
#   run: JOBS="spec servecheck" bash tools/gpu_jobs.sh   (carry .whl/)
# Each job has its own $OUT/<job>/ and is stopped at DEADLINE seconds into the call, so that the tars get made.
# Back in $OUT: one <job>.tar.gz per job (every log and JSON the job wrote); the console shows each job's tail.
source tools/gpu_setup.sh
T0=$SECONDS
rmdir "$R" 2>/dev/null; unset R   # each job gets its own
ENGINE=/tmp/engines/mini
export ENGINE
say() { echo "[$((SECONDS - T0)) s] $*"; }
NGPU=$(nvidia-smi -L | wc -l); NCPU=$(nproc)
say "$NGPU GPU(s), $NCPU cores"

job_suite() {
  timeout -s INT ${SUITE_LIMIT:-300} python3 -m pytest -q -m gpu -n ${SUITE_WORKERS:-8} --dist loadfile -p no:cacheprovider \
    -o faulthandler_timeout=150 --durations=25 -rs tests > $OUT/gpu_tests.log 2>&1
  echo "gpu tests: exit $?, $((SECONDS - T0)) s"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -1
  grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20
}
job_servecheck() {
  [ -f $ENGINE/engine.json ] || { echo "no engine at $ENGINE"; return 1; }
  local t1=$SECONDS
  k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve_default.log 2>&1 &
  local pid=$!
  for _ in $(seq 360); do curl -sf localhost:30000/health >/dev/null && break; sleep 0.5; done
  echo "serve (default flags): /health OK $((SECONDS - t1)) s after start"
  grep -E "memory:|warm-up" $OUT/serve_default.log | head -3
  timeout 90 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1; echo "serve_check: exit $?"
  cat $OUT/serve_check.txt
  kill $pid; wait $pid 2>/dev/null
}
job_kda() {  # the KDA kernels' GPU tests (P5, verify inputs, fold), e.g. after a change to how they are compiled
  timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rs tests/passes/kernels/test_kda_decode.py \
    tests/passes/test_p05_fused_kda_decode.py tests/runtime/spec/test_fold_gpu.py > $OUT/kda_tests.log 2>&1
  echo "kda GPU tests: exit $?"; grep -E "passed|failed" $OUT/kda_tests.log | tail -1
  grep -E "^(FAILED|ERROR)|^E  " $OUT/kda_tests.log | head -20
}
job_gate() {  # the ladder's accuracy gate with pinned routing at a real shape (issue 9), batch 1, few timed steps
  timeout ${GATE_LIMIT:-240} k3compile bench ladder --model ${GATE_MODEL:-k3-mini-6b} --dtype bf16 --batch 1 \
    --context 512 --device cuda --quick --reps 2 --out $OUT/g > $OUT/gate.log 2>&1; echo "gate ladder: exit $?"
  rm -rf $OUT/g/traces; grep -E "^\| r|^- |router biases" $OUT/g/ladder_*.md | head -70
}
job_prefill() { bash tools/gpu_prefill6.sh; }   # prefill time vs requests at fixed tokens (prefill6)
job_twogpu() {
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/parallel/test_parallel_engine_gpu.py
}
job_spec() {
  timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
    --verify-graphs > $OUT/build.log 2>&1; echo "build: exit $? at $((SECONDS - T0)) s"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/spec/test_fold_gpu.py > $OUT/fold_gpu.txt 2>&1
  echo "fold GPU test: exit $?"; tail -3 $OUT/fold_gpu.txt
  local prof=${PROFILE:-}   # a profile measured earlier (traces/), else measure one now
  if [ -z "$prof" ]; then
    timeout 100 k3compile profile verify --engine $ENGINE --device cuda --batch 1,8,64,256 --tokens 5 \
      --context 512 --steps 10 --warmup 3 --out $OUT/profiles > $OUT/profile.log 2>&1; echo "profile: exit $?"
    grep -v -i warn $OUT/profile.log | tail -12; prof=$(ls $OUT/profiles/*.json 2>/dev/null | head -1)
  fi
  timeout ${SPEC_LIMIT:-150} k3compile bench spec --engine $ENGINE --device cuda --batch 1,8,64,256 --gamma 4 \
    --proposer controlled --accept-p 0.7 --acceptance ${ACCEPTANCE:-forced} ${prof:+--profile $prof} --prompt-len 64 \
    --max-new-tokens 32 --memory-gib 24 --out $OUT/spec > $OUT/spec.log 2>&1; echo "bench spec: exit $?"
  grep -v -i warn $OUT/spec.log | tail -25
}
job_gemv() {  # cuBLAS vs P8's Triton GEMV candidates (dot and rows designs) at the 48B shapes, + their GPU tests
  timeout 150 python3 tools/bench_gemv.py --json $OUT/gemv.json 2>&1 | grep -v -i warn | tee $OUT/gemv.txt
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/passes/test_p08_small_m_gemm.py > $OUT/p08_tests.log 2>&1
  echo "p08 tests: exit $?"; tail -2 $OUT/p08_tests.log; grep -E "^(FAILED|ERROR)|^E  " $OUT/p08_tests.log | head
}
job_moe7() { bash tools/gpu_moe7.sh; }     # moe7's MoE kernel designs (bench + GPU tests)
job_moe8() { bash tools/gpu_moe8.sh; }     # moe8: kernel A's shared slot (bench + GPU tests)
job_route7() { bash tools/gpu_route7.sh; } # route7's router-in-routing kernel (bench + GPU tests)
job_route8() { bash tools/gpu_route8.sh; } # route8's norm + router kernel (bench + GPU tests)
job_kda8() { bash tools/gpu_kda8.sh; }     # kda8: KDA kernel prefetch before gdc_wait, P8 GEMVs with PDL
job_mla8() {  # P15's merge kernel with W_UV, and the whole pipeline's GPU tests
  timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider --durations=5 tests/passes/kernels/test_mla_decode.py \
    tests/passes/test_gpu_pipeline.py tests/passes/test_p08_small_m_gemm.py \
    -k "not prefill" 2>&1 | tee $OUT/mla8_tests.log | tail -15
}
job_p16() { bash tools/gpu_p16.sh; }   # P16 bit-identity through the verify graph, with its off-control
job_serve() { SERVE_BUDGET=$((DEADLINE - 20)) bash tools/gpu_serve15.sh; }
job_ladder() { bash tools/gpu_ladder3.sh; }

run_job() {  # NAME: the job with its own $OUT and $R, stopped at the call's deadline
  local name=$1 left=$((DEADLINE - (SECONDS - T0)))
  [ $left -gt 30 ] || { say "$name: skipped ($left s left)"; return; }
  mkdir -p $OUT/$name
  ( export OUT=$OUT/$name R=$OUT/$name/r
    say "$name: start ($left s left)"
    timeout -k 5 $left bash tools/gpu_jobs.sh job $name > $OUT/console.txt 2>&1
    say "$name: exit $?" )
}

DEADLINE=${DEADLINE:-575}
[ "${1:-}" = job ] && { job_$2; exit; }
for j in ${JOBS:-suite}; do run_job $j; done

for d in $OUT/*/; do
  n=$(basename $d); rm -rf $d/r
  echo "===== $n"; grep -v -i warn $d/console.txt | tail -40
  tar czf $OUT/$n.tar.gz -C $OUT $n && rm -rf $d
done
say "all done"; ls -la $OUT
