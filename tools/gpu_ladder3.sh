#!/usr/bin/env bash
# One H200 call (< 9 minutes): the decode kernel ladder with every anchor of issue 9 in the same device call.
#   1. Kimi-Linear-48B-A3B shape (random bf16 weights, ~98 GB), batch 1/8/64, context 512:
#      transformers KimiLinearForCausalLM + fla first, in its own process (`--hf`: two 98 GB copies do not fit),
#      then eager / torch.compile(reduce-overhead) / every rung (engine-before = after P1-P4, engine-after = last),
#      with the per-rung accuracy gate (logits vs the previous rung, greedy agreement) at each batch size, routing
#      pinned (the verdict) and free, its tolerance calibrated by a rounding-only probe, bug probes beside it.
#   2. k3-mini-6b, batch 1/8: the same without transformers (it has no K3 model).
#
#   run: bash tools/gpu_ladder3.sh          (carry .whl/ for fla-core, as tools/gpu_setup.sh expects)
#
# Session 7: the transformers process (fla's first-call compile included) did not finish in 90 s and the 48B run
# at batch 64 plus k3-mini did not fit: now B48=1,8 and MINI=0 by default (batch 64 and k3-mini-6b:
# tools/gpu_ladder_rest.sh), HF_BUDGET=150, C48=120 (torch.compile at 48B batch 1 took 109 s).
# Budgets (seconds, env overrides): HF_BUDGET (transformers process; killed at 1.5x), T48=255 / C48
# (our 48B run / its torch.compile time), T6=95 / C6=60 (k3-mini-6b); worst case ~505 s with setup. A compile that would overrun its budget is
# skipped with the reason in the table; arms that would start after --time-budget are skipped; `timeout` kills a run
# that still overruns, and the JSON/markdown written after each batch size stay. --quick: 40 steps x 5 reps per arm,
# a repetition capped at 0.5 s (slow arms time >= 10 steps), 20 warm-up steps, 3 gate steps: a smoke run by
# docs/BENCHMARKS.md (the markdown says so); the ratios in one run are what it is for.
#
# Back in $OUT (at most 8 files): ladder_<model>_bf16.{json,md,png} for both models, ladder3.log, ladder3_traces.tar
# (bs1 traces of engine-before and engine-after, the transformers process's JSON); `k3compile report TRACE` reads
# a trace on CPU afterwards (no device time spent on reports here).
source tools/gpu_setup.sh
set -o pipefail
T_START=$SECONDS
HF_BUDGET=${HF_BUDGET:-150}; T48=${T48:-255}; C48=${C48:-120}; T6=${T6:-95}; C6=${C6:-60}
B48=${B48:-1,8}; MINI=${MINI:-0}  # session 7: bs64 and k3-mini did not fit one call: tools/gpu_ladder_rest.sh runs them
LOG=$OUT/ladder3.log
progress() { echo "[$((SECONDS - T_START)) s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG" 2>&1
python3 -c "import k3compile.passes.registry as r; print('pipeline:', ', '.join(r.registered_passes()))" 2>&1 | tee -a "$LOG"
python3 -c "import fla, transformers; print('fla', fla.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$LOG"

VARGS=(); for v in ${VARIANTS:-}; do VARGS+=(--variant "$v"); done  # whole-engine A/B arms (bench ladder --variant)
ladder() {  # model, batches, hard timeout (s), extra flags...
  local model=$1 batches=$2 limit=$3; shift 3
  progress "ladder $model (batch $batches, limit $limit s): $*"
  timeout "$limit" k3compile bench ladder --model "$model" --dtype bf16 --batch "$batches" --context 512 --device cuda \
    --quick --compile "$@" --out "$R/$model" 2>&1 | grep -v -i warn >> "$LOG"
  progress "ladder $model: exit $?"
  cp "$R/$model"/ladder_*.json "$R/$model"/ladder_*.md "$R/$model"/ladder_*.png "$OUT/" 2>/dev/null
  grep -h -E "^\[.*(rep [0-9]|compiled|skipped|gate|over the tolerance|failed|hf )" "$LOG" | tail -4
}
ladder kimi-linear-48b "$B48" $((HF_BUDGET * 3 / 2 + T48 + 25)) --hf --hf-budget "$HF_BUDGET" \
  --time-budget "$T48" --compile-budget "$C48" "${VARGS[@]}"
[ "$MINI" = 1 ] && ladder k3-mini-6b 1,8 $((T6 + 25)) --time-budget "$T6" --compile-budget "$C6"
(cd "$R" && tar cf "$OUT/ladder3_traces.tar" */traces/*_bs1.* */hf_*.json 2>>"$LOG")
rm -rf "$R"  # under $OUT: its copies would count against the files that come back
for md in "$OUT"/ladder_*.md; do
  echo "== $md"; grep -A16 "^| arm |" "$md"; grep -E "^- batch|^\| r|^\| v-|^- v-|^- routing|^- bs[0-9]+, routing|^- tolerance used|torch.compile\(|^hf-" "$md" | head -60
done
progress "all done"
ls -la "$OUT"
