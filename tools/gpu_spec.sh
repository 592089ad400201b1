#!/usr/bin/env bash
# Issue 13 on the H200, one call (< 5 min): speculative decoding with ReplaySSM.
#   1. GPU bit-identity: the ReplaySSM fold kernel vs P5's fused decode kernel (torch.equal on state + conv).
#   2. build k3-mini-6b (bf16, all passes) with the verify step (--verify-graphs).
#   3. k3compile profile verify on it: T(batch, verify tokens per request), CUDA graphs per bucket.
#   4. k3compile bench spec on it with the CONTROLLED-ACCEPTANCE ORACLE (not a drafter: drafts the target's
#      own greedy token with probability P; random weights make a real drafter meaningless at this size):
#      none vs verify-all vs trim (planner on the profile just measured), batch 1..256.
# Back in $OUT: fold_gpu.txt, build.log, profiles/<device>__k3-mini-6b.{json,md,png}, profile.log,
# spec_k3-mini-6b.{json,md}, spec.log. Knobs: P (0.7), GAMMA (4), BATCH (1,8,64,256), NEW (32).
source tools/gpu_setup.sh
ENGINE=/tmp/engines/mini-spec
P=${P:-0.7}; GAMMA=${GAMMA:-4}; BATCH=${BATCH:-1,8,64,256}; NEW=${NEW:-32}
T0=$SECONDS
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/runtime/spec/test_fold_gpu.py 2>&1 | tail -15 > $OUT/fold_gpu.txt
cat $OUT/fold_gpu.txt; echo "fold test done ($((SECONDS - T0)) s)"
timeout 200 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  --verify-graphs > $OUT/build.log 2>&1; echo "build: exit $? ($((SECONDS - T0)) s)" | tee -a $OUT/build.log
grep -E "verify:|saving|error|Error" $OUT/build.log | tail -16
timeout 100 k3compile profile verify --engine $ENGINE --device cuda --batch $BATCH --tokens $((GAMMA + 1)) \
  --context 512 --steps 10 --warmup 3 --out $OUT/profiles > $OUT/profile.log 2>&1
echo "profile: exit $? ($((SECONDS - T0)) s)"; grep -v -i warn $OUT/profile.log | tail -24
PROF=$(ls $OUT/profiles/*.json 2>/dev/null | head -1)
timeout $((285 - (SECONDS - T0))) k3compile bench spec --engine $ENGINE --device cuda --batch $BATCH --gamma $GAMMA \
  --proposer controlled --accept-p $P ${PROF:+--profile $PROF} --prompt-len 64 --max-new-tokens $NEW \
  --memory-gib 24 --out $R/spec > $OUT/spec.log 2>&1
echo "bench spec: exit $? ($((SECONDS - T0)) s)"
cp $R/spec/spec_*.json $R/spec/spec_*.md $OUT/ 2>/dev/null; rm -rf $R
grep -v -i warn $OUT/spec.log | tail -30
echo "all done ($((SECONDS - T0)) s)"
