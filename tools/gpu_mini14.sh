#!/usr/bin/env bash
# Session 14, helper mini14 (issue 9): k3-mini-6b batch 1, p07_moe_out_norm (OFF by default): each latent MoE's kernel
# C runs the next AttnRes norm as its last program's tail (k3::fused_moe_decode_norm), 28 launches a step less.
#   1. GPU tests at k3-mini's shape (the fused kernel vs the pair it replaces: p bit for bit, h 1e-2; CUDA-graph replays)
#   2. bench ladder, k3-mini-6b bf16, batch 1, context 512, --quick, no --compile, variants (each judged against
#      engine-after by the ladder's accuracy gate, timed interleaved in the same run), in this order:
#        v-mon      p07_moe_out_norm on, kernel C's own launch (4 columns a program: 512 programs; with the tail ptxas
#                   gives C 211 registers a thread instead of 96, 2 programs an SM instead of 5: two waves)
#        v-mon8     the same with block_n=8 (256 programs: one wave at 2 an SM)
#        v-rpcpbd   session 13's two options together, without the tail (never measured together): the combination's base
#        v-all      v-rpcpbd + p07_moe_out_norm block_n=8
#        v-all4     v-rpcpbd + p07_moe_out_norm, C's own launch
#        v-monw8    p07_moe_out_norm with 8 warps (124 registers, 2 programs of 8 warps an SM)
#   3. `k3compile report` of engine-after's and v-mon8's batch-1 traces (kernel counts and per-kernel us)
#   run: bash tools/gpu_mini14.sh   (carry .whl/ as for the other gpu_*.sh); ~30 s tests, TL=150 s ladder + 40 s reports
# Back in $OUT: ladder_k3-mini-6b_bf16.{md,json,png}, call.log, report_after.txt, report_mon8.txt, logs.tar (tests.log,
# ladder.log, report_*.json)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/call.log; }
mkdir -p $OUT/logs
[ "${TESTS:-1}" = 1 ] && run_gpu_tests ${TEST_EACH:-90} "tests/passes/test_p07_moe_out_norm.py::cuda"
P6=p06_fused_moe_decode; P8=p08_small_m_gemm; M=p07_moe_out_norm
RPCPBD="$P8.rows_programs=132+264+528,$P6.latent_prewait=true,$P6.down_early_release=true"
VARIANTS="mon:$M.enabled=true mon8:$M.enabled=true,$M.block_n=8 rpcpbd:$RPCPBD"
VARIANTS="$VARIANTS all:$RPCPBD,$M.enabled=true,$M.block_n=8 all4:$RPCPBD,$M.enabled=true monw8:$M.enabled=true,$M.num_warps=8"
VARGS=(); for v in $VARIANTS; do VARGS+=(--variant "$v"); done
timeout $(( ${TL:-150} + 30 )) k3compile bench ladder --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
  --device cuda --quick --time-budget ${TL:-150} --keep-traces all "${VARGS[@]}" --out $OUT/l6 > $OUT/logs/ladder.log 2>&1
say "ladder: exit $?"
TR=$(ls $OUT/l6/traces/*_r[0-9][0-9]-*bs1.json.gz 2>/dev/null | sort | tail -1)  # the last rung: engine-after
[ -n "$TR" ] && timeout 40 k3compile report "$TR" --top 14 --json $OUT/logs/report_after.json > $OUT/report_after.txt 2>&1
TV=$(ls $OUT/l6/traces/*v-mon8_bs1.json.gz 2>/dev/null | tail -1)
[ -n "$TV" ] && timeout 40 k3compile report "$TV" --top 14 --json $OUT/logs/report_mon8.json > $OUT/report_mon8.txt 2>&1
mv $OUT/l6/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l6
for md in $OUT/ladder_*.md; do grep -E "^\| (arm|r04|r1[45]|v-)|^- (batch|routing|tolerance)" "$md" | cut -c1-200; done
grep -E "$M" $OUT/logs/ladder.log | grep -iE "v-|variant|error|fail" | head -8
for r in $OUT/report_after.txt $OUT/report_mon8.txt; do
  [ -f $r ] && { echo "== $r"; grep -A1 "^step " $r | head -4; grep -A10 "^Top GPU kernels" $r | cut -c1-110; }
done
(cd $OUT && tar cf logs.tar logs && rm -rf logs)
say "done"
