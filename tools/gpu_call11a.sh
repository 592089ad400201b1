#!/usr/bin/env bash
# Session 11, device call 1 (issue 9): where the time goes.
#   1. bench ladder, Kimi-Linear-48B shape, batch 1 (--quick), the last rung's trace kept -> `k3compile report`
#      of engine-after with the top 60 kernels (what a step spends, kernel by kernel)
#   2. k3-mini-6b engine from `k3compile build`, then tools/diag_serve11.py on it (the engine `serve` builds,
#      in-process, under cProfile: warm-up, 16 short prompts, the same again, 16 new lengths)
#   run: TL=150 bash tools/gpu_call11a.sh   (carry .whl/)
source tools/gpu_setup.sh
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
timeout ${TL:-150} k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1 --context 512 \
  --device cuda --quick --time-budget $(( ${TL:-150} - 25 )) --out $OUT/l48 > $OUT/ladder.log 2>&1
say "ladder: exit $?"
TR=$(ls $OUT/l48/traces/*r1[0-9]*bs1.json.gz 2>/dev/null | tail -1)
[ -n "$TR" ] && k3compile report "$TR" --top 60 --json $OUT/report48.json > $OUT/report48.md 2>&1; say "report: $TR"
mv $OUT/l48/ladder_* $OUT/ 2>/dev/null; rm -rf $OUT/l48
grep -E "^\| (arm|eager|r04|r1[0-9])" $OUT/ladder_*.md | cut -c1-160
head -80 $OUT/report48.md
ENGINE=/tmp/engines/mini
timeout 150 k3compile build --model k3-mini-6b --topology single --dtype bf16 --device cuda -o $ENGINE --overwrite \
  > $OUT/build_mini.log 2>&1; say "build: exit $?"; tail -3 $OUT/build_mini.log
timeout ${TD:-270} python3 tools/diag_serve11.py $ENGINE $OUT > $OUT/diag_serve.log 2>&1; say "diag: exit $?"
grep -E "^== |metrics" $OUT/diag_serve.txt
say "done"
