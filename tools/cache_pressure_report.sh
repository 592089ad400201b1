#!/usr/bin/env bash
# Issue 15's cache benchmark on this CPU (no GPU needed): tune on seed 0, then report every policy
# on seeds 1-3 at three budgets (generous -> tight). The engine runs with the stand-in forward
# (bench/cache_replay.py: scheduler, cache and pools as in serving, no model forward).
# Traces: bench/cache_traces.py's defaults (production-shaped, log-normal lengths), 24 roots over
# 90 simulated seconds (105-161 requests per agent / tot_fork trace and seed, 2000-3500 per
# prompted-ToT trace). The agent and tot_fork traces run side by side (two processes), then one
# report is merged from them. ~25-35 min on a shared 2-core CPU.
# Usage: tools/cache_pressure_report.sh [OUT_DIR] [ROOTS] [PHASES]
#   defaults: traces/cache_pressure, 24, "tune report"; extra phases: tot (the prompted
#   tree-of-thought trace, seeds 1-3, budgets chosen on seed 0: tot_tune_seed0), tot_tune, k3 (K3's
#   state/KV byte ratio, seed 1), unified (the agent trace on the unified arena) and unified_tot
#   (the prompted ToT trace on it), unified_tot_fork (the tot_fork trace on it), decay (session 9's `valued`
#   re-run on seeds 1-3, merged with the unchanged policies' rows), s10 / s10_psl_off (session 10's `valued`
#   likewise, all three traces; without protect_shared_leaves), s10_unified / s10_unified_16 (the three traces on the
#   unified arena at their tight budget / 16 MiB), s10_unified_psl_off (`valued` without protect_shared_leaves
#   there), s11 (session 11: the feasibility-bound columns, seeds 1-3, merged over s10_report), s11_short (`valued`
#   with short-lived checkpoints, a variant, not the default), s12 (session 11, part 2: short ages only off reused lines, merged
#   over s11_short), s13_arena / s13_arena_k3 (session 12: unified vs SGLang's default split vs the best split of a
#   sweep of state shares, k3-tiny's and K3's byte sizes), s13_sparse (session 12: `sparse` re-run against today's
#   `valued`, and `bench cache`'s chat workload), s13_root (session 12: never-hit root-anchored checkpoints stale on all
#   traffic, the `valued` default since), s14 (session 13: KV pressure by recency, KV-only leaves after a decay, tot's
#   bytes / hits frontier; seed 0, then seeds 1-3 merged over s13_root), s14_unified (the adopted change on the unified
#   arena), e.g. PHASES="k3 unified"
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-traces/cache_pressure}
ROOTS=${2:-24}
PHASES=${3:-tune report}
export OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
# --split-pools: every phase before s18 ran on split pools, then the bench default (a later --unified wins)
BENCH="$PY -m k3compile.cli bench cache-pressure --split-pools --roots $ROOTS --duration 90"
if [[ " $PHASES " == *" tune "* ]]; then
  # tuning (seed 0 only): value weight and per-path cap at the two tighter budgets
  $BENCH --seeds 0 --budgets-kib 16384,8192 --out "$OUT/tune_seed0" \
      --policies "end;every_chunk;sparse;valued;valued:weight=0.25;valued:weight=4;valued:per_path=1"
fi
if [[ " $PHASES " == *" report "* ]]; then
  # report (seeds never used for tuning), one process per trace
  pids=()
  for trace in agent tot_fork; do
    $BENCH --traces $trace --seeds 1,2,3 --budgets-kib 65536,16384,8192 --out "$OUT/report_$trace" \
        > "$OUT/report_$trace.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  $PY -c "from k3compile.bench.cache_pressure import merge; print(merge(['$OUT/report_agent', '$OUT/report_tot_fork'], '$OUT/report'))"
fi
if [[ " $PHASES " == *" tot_tune "* ]]; then
  # the prompted ToT trace's budgets, chosen here (seed 0): LRU-KV at equal pages reaches the bound
  # at all three (its KV working set is small); what eviction decides is the state pool, which
  # sparse/valued already overflow at 16 MiB, and 4 MiB costs valued 5 points of hit rate against
  # 16 MiB, so the report's tight budget is 4 MiB
  $BENCH --traces tot --seeds 0 --budgets-kib 16384,8192,4096 --out "$OUT/tot_tune_seed0"
fi
if [[ " $PHASES " == *" tot "* ]]; then
  # value calls as one request with n=3 (forked from one prefill); session 7's tot_report/ has them as
  # 3 requests (TraceSpec.tot_samples_as_requests). One process per budget, then one report.
  pids=()
  for kib in 65536 16384 4096; do
    $BENCH --traces tot --seeds 1,2,3 --budgets-kib $kib --out "$OUT/tot_n3_report_$kib" \
        > "$OUT/tot_n3_report_$kib.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  $PY -c "from k3compile.bench.cache_pressure import merge; print(merge(['$OUT/tot_n3_report_65536', '$OUT/tot_n3_report_16384', '$OUT/tot_n3_report_4096'], '$OUT/tot_n3_report'))"
fi
if [[ " $PHASES " == *" decay "* ]]; then
  # session 9: `valued` with unused-checkpoint decay and protect_reused (runtime/cache_policy.py; chosen on
  # seed 0: decay_tune_seed0/) re-run on the report's seeds and budgets, with `none` (tokens saved, outputs);
  # end / every_chunk / sparse did not change and come from report/ and tot_n3_report/, the old `valued`
  # rows stay as `valued@s8`. One process for agent, one per tot budget, then one merged report.
  pids=()
  $BENCH --traces agent --seeds 1,2,3 --budgets-kib 65536,16384,8192 --policies "none;valued" \
      --out "$OUT/decay_report_agent" > "$OUT/decay_report_agent.log" 2>&1 &
  pids+=($!)
  for kib in 65536 16384 4096; do
    $BENCH --traces tot --seeds 1,2,3 --budgets-kib $kib --policies "none;valued" --out "$OUT/decay_report_tot_$kib" \
        > "$OUT/decay_report_tot_$kib.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  $PY -c "from k3compile.bench.cache_pressure import merge_rerun; print(merge_rerun(['$OUT/report', '$OUT/tot_n3_report'], ['$OUT/decay_report_agent', '$OUT/decay_report_tot_65536', '$OUT/decay_report_tot_16384', '$OUT/decay_report_tot_4096'], '$OUT/decay_report', 's8'))"
fi
for phase in s10 s10_psl_off; do
  if [[ " $PHASES " == *" $phase "* ]]; then
    # session 10: `valued` with stale_age, the root's new-family clock and protect_shared_leaves (chosen on seed 0:
    # s10_tune_seed0/) re-run on the report's seeds and budgets on split pools (agent, tot with n=3, tot_fork),
    # merged with the earlier rows (decay_report/ for agent and tot, report/ for tot_fork; session 9's valued stays
    # as valued@s9, report/'s as valued@s8); `none` not re-run (unchanged code, its rows are the earlier ones).
    # s10_psl_off: the same without protect_shared_leaves (as run in session 10, when it was briefly off by
    # default, the rows say `valued`). One process per trace (tot: per budget), each saving after every run.
    name=s10_report; policy=valued
    [[ $phase == s10_psl_off ]] && name=s10_report_psl_off && policy="valued:protect_shared=0"
    pids=()
    $BENCH --traces agent --seeds 1,2,3 --budgets-kib 65536,16384,8192 --policies "$policy" \
        --out "$OUT/${name}_agent" > "$OUT/${name}_agent.log" 2>&1 &
    pids+=($!)
    for kib in 4096 16384 65536; do
      $BENCH --traces tot --seeds 1,2,3 --budgets-kib $kib --policies "$policy" --out "$OUT/${name}_tot_$kib" \
          > "$OUT/${name}_tot_$kib.log" 2>&1 &
      pids+=($!)
    done
    $BENCH --traces tot_fork --seeds 1,2,3 --budgets-kib 65536,16384,8192 --policies "$policy" \
        --out "$OUT/${name}_tot_fork" > "$OUT/${name}_tot_fork.log" 2>&1 &
    pids+=($!)
    for pid in "${pids[@]}"; do wait "$pid"; done
    $PY -c "from k3compile.bench.cache_pressure import merge_rerun; print(merge_rerun(['$OUT/decay_report', '$OUT/report'], ['$OUT/${name}_agent', '$OUT/${name}_tot_65536', '$OUT/${name}_tot_16384', '$OUT/${name}_tot_4096', '$OUT/${name}_tot_fork'], '$OUT/${name}', {'$OUT/decay_report': 's9', '$OUT/report': 's8'}))"
  fi
done
for phase in s10_unified s10_unified_16; do
  if [[ " $PHASES " == *" $phase "* ]]; then
    # session 10: the unified arena, seeds 1-3, every policy but sparse (time: the CPU is shared), one process per
    # trace: s10_unified at each trace's tight budget (agent and tot_fork 8 MiB, tot with n=3 4 MiB), s10_unified_16
    # at 16 MiB
    pids=()
    specs="agent:8192 tot:4096 tot_fork:8192"
    [[ $phase == s10_unified_16 ]] && specs="agent:16384 tot:16384 tot_fork:16384"
    for spec in $specs; do
      $BENCH --unified --traces ${spec%%:*} --seeds 1,2,3 --budgets-kib ${spec##*:} \
          --policies "none;end;every_chunk;valued" --out "$OUT/${phase}_${spec%%:*}" \
          > "$OUT/${phase}_${spec%%:*}.log" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    $PY -c "from k3compile.bench.cache_pressure import merge; print(merge(['$OUT/${phase}_agent', '$OUT/${phase}_tot', '$OUT/${phase}_tot_fork'], '$OUT/${phase}'))"
  fi
done
if [[ " $PHASES " == *" s10_unified_psl_off "* ]]; then
  # session 10: `valued` without protect_shared_leaves on the unified arena at both budgets (run while it was briefly
  # off by default: the rows say `valued`), merged over s10_unified / s10_unified_16, whose `valued` stays as valued@psl
  pids=()
  for spec in agent:8192 tot:4096 tot_fork:8192; do
    $BENCH --unified --traces ${spec%%:*} --seeds 1,2,3 --budgets-kib ${spec##*:} --policies "valued:protect_shared=0" \
        --out "$OUT/s10_unified_psl_off_${spec%%:*}" > "$OUT/s10_unified_psl_off_${spec%%:*}.log" 2>&1 &
    pids+=($!)
    $BENCH --unified --traces ${spec%%:*} --seeds 1,2,3 --budgets-kib 16384 --policies "valued:protect_shared=0" \
        --out "$OUT/s10_unified_16_psl_off_${spec%%:*}" > "$OUT/s10_unified_16_psl_off_${spec%%:*}.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for phase in s10_unified s10_unified_16; do
    $PY -c "from k3compile.bench.cache_pressure import merge_rerun; print(merge_rerun(['$OUT/${phase}_agent', '$OUT/${phase}_tot', '$OUT/${phase}_tot_fork'], ['$OUT/${phase}_psl_off_agent', '$OUT/${phase}_psl_off_tot', '$OUT/${phase}_psl_off_tot_fork'], '$OUT/${phase}_psl_off', 'psl'))"
  done
fi
# Session 11's phases re-run some policies on the three traces and merge them over an earlier report: agent and
# tot_fork at 64 / 16 / 8 MiB (one process each), tot on seeds 1-3 at 64 / 16 / 4 MiB (one process per budget).
# Args: folder prefix, the report merged over, its re-run rows' label, agent / tot_fork policies and seeds, tot policies.
rerun_over() {
  local name=$1 base=$2 tag=$3 policies=$4 seeds=$5 tot_policies=$6 pids=() parts=()
  for trace in agent tot_fork; do
    $BENCH --traces $trace --seeds $seeds --budgets-kib 65536,16384,8192 --policies "$policies" \
        --out "$OUT/${name}_$trace" > "$OUT/${name}_$trace.log" 2>&1 &
    pids+=($!)
  done
  for kib in 65536 16384 4096; do
    $BENCH --traces tot --seeds 1,2,3 --budgets-kib $kib --policies "$tot_policies" --out "$OUT/${name}_tot_$kib" \
        > "$OUT/${name}_tot_$kib.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for part in agent tot_65536 tot_16384 tot_4096 tot_fork; do parts+=("'$OUT/${name}_$part'"); done
  $PY -c "from k3compile.bench.cache_pressure import merge_rerun; print(merge_rerun(['$OUT/$base'], [$(IFS=,; echo "${parts[*]}")], '$OUT/$name', '$tag'))"
}
if [[ " $PHASES " == *" s11 "* ]]; then
  # session 11: the feasibility bounds (bench/cache_bounds.py: least bytes any policy needs for the goal's hits,
  # most hits any policy gets at the budget; columns of every row) on seeds 1-3, split pools. `valued` is re-run
  # everywhere (its bounds are the goal cells'); on agent and tot_fork `end` and `every_chunk` too (cheap: the
  # budget bound on three policies' schedules); tot's end / every_chunk rows come from s10_report/ (unchanged
  # code). Merged over s10_report/ (re-run policies' old rows: @s10).
  rerun_over s11_report s10_report s10 "end;every_chunk;valued" 1,2,3 "valued"
fi
if [[ " $PHASES " == *" s11_short "* ]]; then
  # session 11: `valued` with short-lived checkpoints (stale 15, ttl 8, max_age 8; chosen on seed 0's tot at 64 MiB only,
  # s11_tune_seed0*/), agent and tot_fork with seed 0 as the tuning check, tot on seeds 1-3; merged over s11_report/
  # (its end / every_chunk / valued rows for the ratios and goals)
  rerun_over s11_short s11_report x "valued:stale=15,ttl=8,max_age=8" 0,1,2,3 "valued:stale=15,ttl=8,max_age=8"
fi
if [[ " $PHASES " == *" s12 "* ]]; then
  # session 11, part 2: `valued` with short ages only for checkpoints off a reused line (radix.py "Reused lines":
  # short_stale 15, short_ttl 8, short_max_age 8, the long ages 300 / 48 / 40 for a state continuing a line a request
  # already restored from; chosen on seed 0 only), agent and tot_fork with seed 0 as the tuning check, tot on seeds
  # 1-3; merged over s11_short/ (valued, the short variant, end, every_chunk rows of the same seeds and budgets).
  SPEC="valued:short_stale=15,short_ttl=8,short_max_age=8"
  rerun_over s12 s11_short x "$SPEC" 0,1,2,3 "$SPEC" > /dev/null
fi
if [[ " $PHASES " == *" k3 "* ]]; then
  $BENCH --byte-ratio k3 --seeds 1 --budgets-kib 65536,16384 --out "$OUT/byte_ratio_k3"
fi
if [[ " $PHASES " == *" unified "* ]]; then
  $BENCH --unified --traces agent --seeds 1,2,3 --budgets-kib 16384,8192 --out "$OUT/unified_agent"
fi
if [[ " $PHASES " == *" unified_tot "* ]]; then
  $BENCH --unified --traces tot --seeds 1,2,3 --budgets-kib 16384,4096 --out "$OUT/unified_tot"
fi
if [[ " $PHASES " == *" unified_tot_fork "* ]]; then  # the whole-context-fork ToT shape on the unified arena
  $BENCH --unified --traces tot_fork --seeds 1,2,3 --budgets-kib 16384,8192 --out "$OUT/unified_tot_fork"
fi
# Session 12 (issue 15, item 4, with the current `valued` default): the unified arena against split pools at SGLang's
# default state share and at a sweep of shares (the best split in hindsight is the sweep's best per cell and metric),
# seeds 1-3; one replay at a time (one process: the CPU is shared). The comparison: k3compile.bench.cache_arenas
# (DIR/arenas.md). A share whose KV pool cannot hold a request's context fails its run (the engine refuses the
# prompt): that split is no way to serve the trace, its log says so, and the sweep goes on (agent at 0.6: a
# 12k-token prompt). Args: folder, trace:budgets specs, shares ("default": SGLang's 0.9 / 1.9), extra bench args.
arena_sweep() {
  local dir=$1 specs=$2 shares=$3 extra=${4:-} spec trace kibs f share
  mkdir -p "$dir"
  for spec in $specs; do
    trace=${spec%%:*} kibs=${spec##*:}
    $BENCH $extra --unified --traces $trace --seeds 1,2,3 --budgets-kib $kibs --policies valued \
        --out "$dir/unified_$trace" > "$dir/unified_$trace.log" 2>&1
    for f in $shares; do
      share=(); [[ $f != default ]] && share=(--state-fraction $f)
      $BENCH $extra "${share[@]}" --traces $trace --seeds 1,2,3 --budgets-kib $kibs --policies valued \
          --out "$dir/split_${f}_$trace" > "$dir/split_${f}_$trace.log" 2>&1 \
          || echo "split $f on $trace: failed (a request does not fit), see its log"
    done
  done
  $PY -m k3compile.bench.cache_arenas "$dir"
}
if [[ " $PHASES " == *" s13_arena "* ]]; then
  # k3-tiny's byte sizes (a state slot = 4.2 KV pages), each trace at 16 MiB and its tight budget.
  # S13_SPECS: a subset to (re-)run, e.g. S13_SPECS="tot:16384,4096".
  arena_sweep "$OUT/s13_arena" "${S13_SPECS:-agent:16384,8192 tot_fork:16384,8192 tot:16384,4096}" \
      "0.05 0.1 0.2 0.3 default 0.6"
fi
if [[ " $PHASES " == *" s13_arena_k3 "* ]]; then
  # K3's byte sizes at TP 8 (a state slot = 127 KV pages: states are the scarce resource), agent and tot_fork at 64
  # and 16 MiB (53 and 12 slots at SGLang's share)
  arena_sweep "$OUT/s13_arena_k3" "agent:65536,16384 tot_fork:65536,16384" "0.1 0.2 0.3 default 0.6 0.8" "--byte-ratio k3"
fi
if [[ " $PHASES " == *" s13_sparse "* ]]; then
  # session 12: the engine's default cache policy (`sparse` until now) against `valued` on issue 15's traces: `sparse`
  # re-run with today's code on seeds 1-3 at every budget (one replay at a time), merged over s12/ (its `sparse` rows,
  # session 8's code, stay as sparse@s8); then `bench cache`'s own workload (chat, 12 roots, seed 0, 64 MiB) with both.
  for spec in agent:65536,16384,8192 tot_fork:65536,16384,8192 tot:65536,16384,4096; do
    $BENCH --traces ${spec%%:*} --seeds 1,2,3 --budgets-kib ${spec##*:} --policies sparse \
        --out "$OUT/s13_sparse_${spec%%:*}" > "$OUT/s13_sparse_${spec%%:*}.log" 2>&1
  done
  $PY -c "from k3compile.bench.cache_pressure import merge_rerun, goals_side_by_side as g; merge_rerun(['$OUT/s12'], ['$OUT/s13_sparse_agent', '$OUT/s13_sparse_tot_fork', '$OUT/s13_sparse_tot'], '$OUT/s13_sparse', 's8'); print(g('$OUT/s13_sparse', {'sparse': 'sparse', 'valued': 'valued:short_stale=15,short_ttl=8,short_max_age=8'}))"
  # --forward cost: the same cache decisions as k3-tiny's own forward (its default), which took over 7 min for `none`
  # alone on the shared CPU
  $PY -m k3compile.cli bench cache --forward cost --policies "none;end;every_chunk;sparse;valued" --out "$OUT/s13_bench_cache" \
      > "$OUT/s13_bench_cache.log" 2>&1
fi
if [[ " $PHASES " == *" s13_root "* ]]; then
  # session 12: never-hit root-anchored checkpoints go stale on all traffic (`root_stale`, the `valued` default since),
  # and with it `short_stale` 25 (a candidate, not adopted); chosen on seed 0 (s13_tune_seed0/: tot at 64, 16, 4 MiB,
  # agent and tot_fork at every budget), then seeds 1-3 once, one replay at a time, merged over s13_sparse/ (today's
  # `valued` before the change is its `valued:short_stale=15,...` rows); s13_root_unified_tot: the change on the
  # unified arena's tot (s13_arena/ has the rows before it)
  P="valued:root_stale=1;valued:root_stale=1,short_stale=25"
  $BENCH --traces tot --seeds 0 --budgets-kib 65536 --policies "every_chunk;valued;$P;valued:root_stale=1,short_stale=20" \
      --out "$OUT/s13_tune_seed0/tot" > "$OUT/s13_tune_seed0/tot.log" 2>&1
  $BENCH --traces tot --seeds 0 --budgets-kib 16384,4096 --policies "every_chunk;valued;$P" \
      --out "$OUT/s13_tune_seed0/tot_16_4" > "$OUT/s13_tune_seed0/tot_16_4.log" 2>&1
  for t in agent tot_fork; do
    $BENCH --traces $t --seeds 0 --budgets-kib 65536,16384,8192 --policies "valued;$P" \
        --out "$OUT/s13_tune_seed0/$t" > "$OUT/s13_tune_seed0/$t.log" 2>&1
  done
  $BENCH --traces tot --seeds 1,2,3 --budgets-kib 65536,16384,4096 --policies "$P" --out "$OUT/s13_root_tot" \
      > "$OUT/s13_root_tot.log" 2>&1
  for t in agent tot_fork; do
    $BENCH --traces $t --seeds 1,2,3 --budgets-kib 65536,16384,8192 --policies "$P" --out "$OUT/s13_root_$t" \
        > "$OUT/s13_root_$t.log" 2>&1
  done
  $PY -c "from k3compile.bench.cache_pressure import merge_rerun, goals_side_by_side as g; merge_rerun(['$OUT/s13_sparse'], ['$OUT/s13_root_tot', '$OUT/s13_root_agent', '$OUT/s13_root_tot_fork'], '$OUT/s13_root', 'x'); print(g('$OUT/s13_root', {'valued': 'valued:short_stale=15,short_ttl=8,short_max_age=8', 'root': 'valued:root_stale=1', 'root25': 'valued:root_stale=1,short_stale=25'}))"
  $BENCH --unified --traces tot --seeds 1,2,3 --budgets-kib 16384,4096 --policies "valued:root_stale=1" \
      --out "$OUT/s13_root_unified_tot" > "$OUT/s13_root_unified_tot.log" 2>&1
fi
if [[ " $PHASES " == *" s14 "* ]]; then
  # session 13: KV pressure deletes leaves by recency alone (`kv_weight=0`), leaves whose state decays keep their KV
  # (`decay_kv`), KV pressure keeping planted branch-point leaves last (`protect_branch`), and on tot the bytes /
  # hit frontier of shorter ages with decay_kv; chosen on seed 0 (s14_tune_seed0/: every trace and budget, with end
  # and every_chunk for the goal columns), then seeds 1-3 once, one replay at a time, with `valued` re-run (today's
  # default; it must reproduce s13_root's `valued:root_stale=1` rows), merged over s13_root/ (its rows stay, `@s13`)
  V="valued:kv_weight=0;valued:decay_kv=1;valued:decay_kv=1,kv_weight=0"
  A="valued:short_ttl=4,short_max_age=4;valued:decay_kv=1,short_ttl=4,short_max_age=4,short_stale=10"
  mkdir -p "$OUT/s14_tune_seed0"
  for spec in agent:65536,16384,8192 tot_fork:65536,16384,8192 tot:65536,16384,4096; do
    t=${spec%%:*}; extra=""
    [[ $t == tot ]] && extra=";$A"
    $BENCH --traces $t --seeds 0 --budgets-kib ${spec##*:} --out "$OUT/s14_tune_seed0/$t" \
        --policies "end;every_chunk;valued;$V;valued:protect_branch=1$extra" > "$OUT/s14_tune_seed0/$t.log" 2>&1
  done
  for spec in agent:65536,16384,8192 tot_fork:65536,16384,8192 tot:65536,16384,4096; do
    t=${spec%%:*}; extra=""
    [[ $t == tot ]] && extra=";$A"
    $BENCH --traces $t --seeds 1,2,3 --budgets-kib ${spec##*:} --policies "valued;$V$extra" --out "$OUT/s14_$t" \
        > "$OUT/s14_$t.log" 2>&1
  done
  $PY -c "from k3compile.bench.cache_pressure import merge_rerun, goals_side_by_side as g; merge_rerun(['$OUT/s13_root'], ['$OUT/s14_agent', '$OUT/s14_tot', '$OUT/s14_tot_fork'], '$OUT/s14', 's13'); print(g('$OUT/s14', {'valued': 'valued', 'kvlru': 'valued:kv_weight=0', 'dkv': 'valued:decay_kv=1', 'both': 'valued:decay_kv=1,kv_weight=0'}))"
fi
if [[ " $PHASES " == *" s14_unified "* ]]; then
  # session 13: the adopted change (`valued` = KV pressure by recency) on the unified arena, where KV pressure decides
  # most, against the value order it replaced (`valued:kv_weight=0.25`), seeds 1-3 at 16 MiB and each trace's tight budget
  for spec in agent:16384,8192 tot_fork:16384,8192 tot:16384,4096; do
    $BENCH --unified --traces ${spec%%:*} --seeds 1,2,3 --budgets-kib ${spec##*:} --policies "valued;valued:kv_weight=0.25" \
        --out "$OUT/s14_unified_${spec%%:*}" > "$OUT/s14_unified_${spec%%:*}.log" 2>&1
  done
fi
if [[ " $PHASES " == *" s18_unified "* ]]; then
  # session 18: every policy (none, end, every_chunk, sparse, valued) on the unified arena with today's code, seeds 1-3,
  # at the split report's budgets: the goal table on the memory `serve` would default to, and `sparse` against
  # `valued` there. One process per trace (tot: per budget), then one merged report.
  pids=(); parts=()
  for spec in agent:65536,16384,8192 tot_fork:65536,16384,8192 tot:65536 tot:16384 tot:4096; do
    name=s18_unified_${spec%%:*}; [[ ${spec%%:*} == tot ]] && name=${name}_${spec##*:}
    $BENCH --unified --traces ${spec%%:*} --seeds 1,2,3 --budgets-kib ${spec##*:} \
        --policies "none;end;every_chunk;sparse;valued" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 &
    pids+=($!); parts+=("'$OUT/$name'")
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  $PY -c "from k3compile.bench.cache_pressure import merge; print(merge([$(IFS=,; echo "${parts[*]}")], '$OUT/s18_unified'))"
fi
