#!/usr/bin/env bash
# P16 (issue 13, item 4) on the H200, one call (~2-4 min): the verify graph stores ReplaySSM window inputs with
# P5's arithmetic, so verify + fold commits P5's state bit for bit.
#   1. tests/passes/test_p16_gpu.py: through the captured verify graph (default pipeline, P16 in it) a verify
#      step + commit vs P5 decoding each layer's recorded inputs: torch.equal on ssm + conv (k3-tiny bf16,
#      kimi-linear-tiny bf16, k3-tiny fp32), and tests/runtime/spec/test_fold_gpu.py (the kernels alone).
#   2. the same check with P16 disabled (the verify graph's torch reference window): expected to FAIL by ulps --
#      shows the pass is what makes it hold (a pass here would mean the check cannot tell).
#   3. k3compile build k3-tiny bf16 --verify-graphs on CUDA: the build log's per-pass verify-graph counts.
# Look at: $OUT/p16_gpu.txt (3 passed), $OUT/p16_off.txt (failures: "states differ"), $OUT/build.log
# ("verify: p16_kda_verify_inputs: 6 matches").
source tools/gpu_setup.sh
T0=$SECONDS
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/passes/test_p16_gpu.py tests/runtime/spec/test_fold_gpu.py \
  2>&1 | tail -15 | tee $OUT/p16_gpu.txt
echo "p16 gpu tests done ($((SECONDS - T0)) s)"
K3_P16_OFF=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/passes/test_p16_gpu.py -k "k3-tiny-dtype0" \
  2>&1 | grep -E "states differ|passed|failed" | tail -5 | tee $OUT/p16_off.txt
echo "p16-off control done ($((SECONDS - T0)) s)"
timeout 150 k3compile build --model k3-tiny --dtype bf16 --device cuda --verify-graphs -o /tmp/engines/p16 --overwrite \
  > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/build.log
grep -E "verify:|error|Error" $OUT/build.log | tail -18
