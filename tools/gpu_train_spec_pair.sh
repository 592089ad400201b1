#!/bin/bash
# The trained tiny speculative pair on the GPU (issue 13): `k3compile train` a k3-tiny target on the Python
# stdlib sources, `k3compile train-draft` its DSpark drafter, then the measured greedy acceptance at
# gamma 4/6/8. Longer than the CPU defaults (the GPU has the time). Results under $OUT/r:
#   target/ (checkpoint + target_loss.json/png), drafter/ (checkpoint + drafter_loss.json/png + acceptance.json),
#   train.log, train_draft.log. Look at: final val loss lines, and "[acceptance] gamma G: tau ..." lines.
# Note: the stdlib differs per Python version, so the corpus here (3.12) is not the CPU machine's (3.11).
source tools/gpu_setup.sh
STEPS=${STEPS:-1500}
python3 -m k3compile.cli train --out "$R/target" --device cuda --steps "$STEPS" --batch-size 16 --seq-len 256 \
    --eval-every 250 2>&1 | grep -v "train step" > "$R/train.log"; tail -3 "$R/train.log"
python3 -m k3compile.cli train-draft --target "$R/target" --out "$R/drafter" --device cuda --steps "$STEPS" \
    --batch-size 16 --seq-len 256 --eval-every 250 2>&1 | grep -v "train step" > "$R/train_draft.log"
grep -E "val step|acceptance" "$R/train_draft.log" | tail -8
