#!/usr/bin/env bash
# Fourth H200 call: every gpu-marked test (several never ran on a GPU before), then a short bs1 profile of
# the engine through Inductor so `k3compile report` can say where its kernels go.
source tools/gpu_setup.sh
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee $OUT/gpu_tests.log | tail -40
timeout 200 k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1 --context 512 --steps 20 --reps 2 --warmup 10 \
  --arms engine,engine-inductor --time-budget 180 --out $R/profile 2>&1 | grep -v -i warn | tail -8
for a in engine engine-inductor; do
  k3compile report $R/profile/traces/decode_k3-mini-6b_bf16_${a}_bs1.json.gz --json $OUT/report_${a}_bs1.json --top 30 > $OUT/report_${a}_bs1.txt 2>&1
done
head -45 $OUT/report_engine-inductor_bs1.txt
cp $R/profile/traces/decode_k3-mini-6b_bf16_engine-inductor_bs1.json.gz $OUT/ 2>/dev/null; ls -la $OUT
