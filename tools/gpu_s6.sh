#!/usr/bin/env bash
# Session 6: the open issues' H200 runs in two device calls on nvidia-h200-x2, one single-GPU job per GPU side by side
# (each job sees one GPU and half the cores; on a one-GPU machine the two jobs of a part run one after the other).
#   PART=a  first both GPUs: the two-GPU parallel engine test (issue 16); then
#           job suite (GPU0): the GPU test suite, timed (issue 10; includes the NCCL world-1 P9/P12 tests of issue 16),
#                             then `serve` of the k3-mini-6b engine with default flags + tools/serve_check.py (issue 10)
#           job spec  (GPU1): build k3-mini-6b with verify graphs, ReplaySSM fold bit-identity on the GPU,
#                             `profile verify`, `bench spec` with controlled acceptance (issue 13)
#   PART=b  job serve (GPU0): tools/gpu_serve15.sh, the served-path table (issue 14), reusing the engine
#           job ladder (GPU1): tools/gpu_ladder3.sh, the decode ladder with its anchors (issue 9)
#   run: PART=a bash tools/gpu_s6.sh   (carry .whl/)
# Back in $OUT: one <job>.tar.gz per job (every log and JSON the job wrote) and the console summary.
source tools/gpu_setup.sh
T0=$SECONDS
rmdir "$R" 2>/dev/null; unset R   # each job gets its own
ENGINE=/tmp/engines/mini
export ENGINE
say() { echo "[$((SECONDS - T0)) s] $*"; }
NGPU=$(nvidia-smi -L | wc -l); NCPU=$(nproc)
say "$NGPU GPU(s), $NCPU cores"

job_suite() {
  timeout -s INT 300 python3 -m pytest -q -m gpu -n 4 --dist loadfile -p no:cacheprovider -o faulthandler_timeout=150 \
    --durations=25 -rs tests > $OUT/gpu_tests.log 2>&1
  echo "gpu tests: exit $?, $((SECONDS - T0)) s since the part began" | tee -a $OUT/gpu_tests.log
  for _ in $(seq 300); do [ -f $ENGINE.ready ] && break; sleep 1; done
  [ -f $ENGINE.ready ] || { echo "no engine to serve"; return; }
  local t1=$SECONDS
  k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve_default.log 2>&1 &
  local pid=$!
  for _ in $(seq 360); do curl -sf localhost:30000/health >/dev/null && break; sleep 0.5; done
  echo "serve (default flags): /health OK $((SECONDS - t1)) s after start"
  timeout 90 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1; echo "serve_check: exit $?"
  kill $pid; wait $pid 2>/dev/null
}
job_spec() {
  timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
    --verify-graphs > $OUT/build.log 2>&1; echo "build: exit $? at $((SECONDS - T0)) s"
  [ -f $ENGINE/engine.json ] && touch $ENGINE.ready
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/spec/test_fold_gpu.py > $OUT/fold_gpu.txt 2>&1
  echo "fold GPU test: exit $?"; tail -3 $OUT/fold_gpu.txt
  timeout 100 k3compile profile verify --engine $ENGINE --device cuda --batch 1,8,64,256 --tokens 5 \
    --context 512 --steps 10 --warmup 3 --out $OUT/profiles > $OUT/profile.log 2>&1; echo "profile: exit $?"
  local prof; prof=$(ls $OUT/profiles/*.json 2>/dev/null | head -1)
  timeout 150 k3compile bench spec --engine $ENGINE --device cuda --batch 1,8,64,256 --gamma 4 \
    --proposer controlled --accept-p 0.7 ${prof:+--profile $prof} --prompt-len 64 --max-new-tokens 32 \
    --memory-gib 24 --out $OUT/spec > $OUT/spec.log 2>&1; echo "bench spec: exit $?"
}
job_serve() { SERVE_BUDGET=$((DEADLINE - 20)) bash tools/gpu_serve15.sh; }
job_ladder() { bash tools/gpu_ladder3.sh; }

run_job() {  # NAME GPU CPUS: the job with its own $OUT and $R, one GPU, some cores, ended by the part's deadline
  local name=$1 gpu=$2 cpus=$3 left=$((DEADLINE - (SECONDS - T0)))
  mkdir -p $OUT/$name
  ( export OUT=$OUT/$name R=$OUT/$name/r CUDA_VISIBLE_DEVICES=$gpu
    say "$name: start (GPU $gpu, cores $cpus, $left s left)"
    timeout -k 5 $left taskset -c $cpus bash tools/gpu_s6.sh job $name > $OUT/console.txt 2>&1
    say "$name: exit $?" ) &
}
pair() {  # JOB0 JOB1: side by side on two GPUs, else one after the other
  local half=$((NCPU / 2))
  if [ "$NGPU" -ge 2 ]; then
    run_job $1 0 0-$((half - 1)); run_job $2 1 $half-$((NCPU - 1)); wait
  else
    run_job $2 0 0-$((NCPU - 1)); wait; run_job $1 0 0-$((NCPU - 1)); wait
  fi
}

DEADLINE=${DEADLINE:-575}   # seconds into the part when every job is stopped, so that the tars below get made
[ "${1:-}" = job ] && { job_$2; exit; }
case "${PART:-a}" in
a)
  rm -f $ENGINE.ready
  if [ "$NGPU" -ge 2 ]; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/parallel/test_parallel_engine_gpu.py \
      > $OUT/two_gpu_tests.txt 2>&1; say "two-GPU parallel engine test: exit $?"; tail -3 $OUT/two_gpu_tests.txt
  fi
  pair suite spec ;;
b) pair serve ladder ;;
esac

for d in $OUT/*/; do
  n=$(basename $d); rm -rf $d/r
  echo "===== $n"; grep -v -i warn $d/console.txt | tail -40
  tar czf $OUT/$n.tar.gz -C $OUT $n && rm -rf $d
done
say "all done"; ls -la $OUT
