#!/usr/bin/env bash
# Session 4, first device round, two calls back to back (the machine stays warm between them):
#   PART=checks: issue 10's GPU checks -- the GPU test suite, timed (< 5 minutes asked), then `serve` of a
#                k3-mini-6b engine with default memory flags admitting 16 concurrent completions.
#   PART=kernels: the reworked MoE kernels (tools/bench_moe_kernels.py: old vs new, GB/s, tile sweep) and the
#                split-V KDA kernel + PDL chain (tools/bench_kda_decode.py, tools/bench_pdl_chain.py).
#   run: PART=checks bash tools/gpu_s4_round1.sh ; PART=kernels bash tools/gpu_s4_round1.sh   (carry .whl/)
source tools/gpu_setup.sh
T0=$SECONDS
if [ "${PART:-checks}" = checks ]; then
  python3 -c "import torch, fla; print('torch', torch.__version__, torch.cuda.get_device_name(), 'fla', fla.__version__)"
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=120 --durations=25 -rs \
    --junitxml=$OUT/gpu_tests.xml tests > $OUT/gpu_tests.log 2>&1
  echo "gpu tests: exit $?, $((SECONDS - T0)) s wall" | tee -a $OUT/gpu_tests.log
  grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -20
  ENGINE=/tmp/engines/mini
  timeout 150 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
    > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)"
  k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve.log 2>&1 &
  PID=$!
  for _ in $(seq 120); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
  echo "serve healthy after $((SECONDS - T0)) s"
  timeout 60 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1
  kill $PID; wait $PID 2>/dev/null
  grep -i -E "memory|sized|slots|warm" $OUT/serve.log | head -6; cat $OUT/serve_check.txt
else
  timeout 150 python3 tools/bench_moe_kernels.py $OUT 2>&1 | grep -v -i warn > $OUT/moe_bench.log
  grep -v '^{' $OUT/moe_bench.log | tail -60; echo "moe bench done ($((SECONDS - T0)) s)"
  { timeout 45 python3 tools/bench_kda_decode.py --preset kimi-linear-48b --batch 1 8 64 --no-unfused --replays 30 \
      --out $OUT/kda3_bench_48b.json
    timeout 35 python3 tools/bench_kda_decode.py --preset k3-mini-6b --batch 1 8 64 --no-unfused --replays 30 \
      --layers 21 --out $OUT/kda3_bench_6b.json
    timeout 30 python3 tools/bench_pdl_chain.py --batch 1 8 --replays 30 --out $OUT/kda3_pdl_chain.json
  } 2>&1 | grep -v -i warn > $OUT/kda3_bench.md
  cat $OUT/kda3_bench.md
  [ "${SUITE:-0}" = 1 ] && { T1=$SECONDS; timeout ${SUITE_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider \
    -o faulthandler_timeout=120 --durations=25 -rs --junitxml=$OUT/gpu_tests.xml tests > $OUT/gpu_tests.log 2>&1
    echo "gpu tests: exit $?, $((SECONDS - T1)) s wall" | tee -a $OUT/gpu_tests.log
    grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -20; }
fi
echo "all done ($((SECONDS - T0)) s)"
