#!/usr/bin/env bash
# ONE device call: a real H200 trace of k3-mini-6b bf16 engine decode steps (batch 1, context 512) with the
# attribution run and the same-run peak measurements, its report (text, JSON, HTML), and a --diff against
# the committed engine trace from an earlier round (no node table there, so its layers are unattributed).
#   run: bash tools/gpu_report.sh        (carry .whl as for the other gpu_*.sh scripts)
# Look at: $OUT/report_engine_bs1.txt (attribution line, critical path, roofline, per layer, next fusions),
#          $OUT/report_engine_bs1.html, $OUT/diff_engine_vs_earlier.txt; commit the trace + reports under traces/.
source tools/gpu_setup.sh
T=$OUT/engine_attributed_k3-mini-6b_bf16_bs1.json.gz
timeout 300 python3 tools/profile_engine_step.py --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
  --steps 3 --out "$T" 2>&1 | grep -v -i warn | tail -15
ls -la "$T" || exit 1
timeout 120 k3compile report "$T" --json $OUT/report_engine_bs1.json --html $OUT/report_engine_bs1.html \
  > $OUT/report_engine_bs1.txt 2>&1; echo "report rc $?"
sed -n '/^Critical path/,$p' $OUT/report_engine_bs1.txt | head -60
timeout 120 k3compile report traces/h200_decode/decode_k3-mini-6b_bf16_engine_bs1.json.gz --diff "$T" \
  --json $OUT/diff_engine_vs_earlier.json > $OUT/diff_engine_vs_earlier.txt 2>&1; echo "diff rc $?"
head -30 $OUT/diff_engine_vs_earlier.txt
# the GPU tests of the same paths on k3-tiny (tool and server profiler: attribution >= 90% of replayed time)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/k3compile/engine/test_profiling_gpu.py tests/runtime/server/test_profiling_gpu.py 2>&1 | tail -8
