#!/usr/bin/env bash
# The GPU test suite in one device call, timed per test (--durations=0), aimed at < 5 minutes on one H200:
# 4 xdist workers (Triton compiles are CPU-bound and the box has 16 cores), whole files per worker so the
# 48B-shape MoE tests do not allocate their experts side by side (they ran out of memory under --dist load).
#   run: bash tools/gpu_tests.sh        (carry .whl/ for fla-core, as tools/gpu_setup.sh expects)
# Look at: $OUT/gpu_tests.log -- the pass/fail line, and "slowest durations" (setup/call per test);
# the [gpu] lines name the backends in use (fla for KDA, grouped_mm for MoE).
source tools/gpu_setup.sh
T0=$SECONDS
python3 -c "import torch, fla; print('torch', torch.__version__, torch.cuda.get_device_name(), 'fla', fla.__version__)" \
  2>&1 | tee $OUT/gpu_env.txt
timeout -s INT 560 python3 -m pytest -q -m gpu -n 4 --dist loadfile -p no:cacheprovider -o faulthandler_timeout=120 --durations=0 -rs -s \
  --junitxml=$OUT/gpu_tests.xml tests 2>&1 | tee $OUT/gpu_tests.log | grep -v -i warn | tail -80
echo "gpu tests: exit ${PIPESTATUS[0]}, $((SECONDS - T0)) s wall" | tee -a $OUT/gpu_tests.log
