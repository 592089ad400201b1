#!/usr/bin/env bash
# Session 4, first device call: issue 10's GPU checks (serve of k3-mini-6b with default flags; the GPU test
# suite, timed) and the new MoE / KDA kernels at real shapes (helpers' scripts, when present).
#   run: bash tools/gpu_s4_round1.sh   (carry .whl/)
# Back in $OUT: serve.log, serve_check.txt, gpu_tests.log (+ junit), the kernel benches' JSON and logs.
source tools/gpu_setup.sh
T0=$SECONDS
python3 -c "import torch, fla; print('torch', torch.__version__, torch.cuda.get_device_name(), 'fla', fla.__version__)"
# 1. the GPU suite, timed as the issue asks (< 5 minutes)
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=120 --durations=25 -rs \
  --junitxml=$OUT/gpu_tests.xml tests > $OUT/gpu_tests.log 2>&1
echo "gpu tests: exit $?, $((SECONDS - T0)) s wall" | tee -a $OUT/gpu_tests.log
grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -20
# 2. kernel benches (helpers' scripts print their own summaries)
for s in tools/bench_moe_kernels.py tools/bench_kda3.py; do
  [ -f $s ] && { timeout 100 python3 $s --out $OUT 2>&1 | grep -v -i warn | tail -40; echo "$s done ($((SECONDS - T0)) s)"; }
done
# 3. serve with default memory flags admits concurrent requests (issue 10)
ENGINE=/tmp/engines/mini
timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)"
k3compile serve --model $ENGINE --device cuda --port 30000 > $OUT/serve.log 2>&1 &
PID=$!
for _ in $(seq 150); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
echo "serve healthy after $((SECONDS - T0)) s"
timeout 90 python3 tools/serve_check.py > $OUT/serve_check.txt 2>&1
kill $PID; wait $PID 2>/dev/null
grep -i -E "memory|sized|slots|warm" $OUT/serve.log | head -6; cat $OUT/serve_check.txt
echo "all done ($((SECONDS - T0)) s)"
