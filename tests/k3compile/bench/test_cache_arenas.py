"""bench/cache_arenas.py: unified arena vs split pools (default share and the best of a sweep) on cache-pressure
reports, and bench cache-pressure's --state-fraction, which the sweep runs."""
import argparse
import json

import pytest

from k3compile.bench.cache import parse_policy
from k3compile.bench.cache_arenas import compare, load_rows, main
from k3compile.bench.cache_pressure import register, run_one
from k3compile.bench.cache_replay import StandInModel
from k3compile.bench.cache_traces import TraceSpec, make_trace
from k3compile.runtime.memory.pools import DEFAULT_STATE_FRACTION


def args_for(*extra):
    return register(argparse.ArgumentParser().add_subparsers()).parse_args(list(extra))


def row(share, hit, computed, ttft, sim, seed=1):
    return {"trace": "agent", "seed": seed, "budget_bytes": 8 << 20, "policy": "valued", "requests": 120,
            "prompts": 110, "prompt_tokens": 1000, "kv_only_bound": 0.9, "state_fraction": share, "hit_tokens": hit,
            "fraction_of_bound": hit / 900, "prefill_tokens_computed": computed, "ttft_mean_s": ttft,
            "sim_seconds": sim, "repeats": 2, "repeats_hit": 1 if hit < 800 else 2, "stems": 3, "stems_hit": 3}


def write(tmp_path, name, rows, unified=False, share=None):
    d = tmp_path / name
    d.mkdir()
    (d / "cache_pressure.json").write_text(json.dumps({"args": {"unified": unified, "state_fraction": share},
                                                       "rows": rows}))


def test_best_split_is_chosen_per_metric_and_ratios_favour_unified_above_one(tmp_path):
    write(tmp_path, "unified_agent", [row(None, 800, 200, 0.10, 50.0)], unified=True)
    write(tmp_path, "split_default_agent", [row(DEFAULT_STATE_FRACTION, 500, 500, 0.40, 80.0)])
    write(tmp_path, "split_0.1_agent", [row(0.1, 700, 300, 0.20, 55.0)], share=0.1)
    write(tmp_path, "split_0.3_agent", [row(0.3, 600, 400, 0.15, 60.0)], share=0.3)
    (cell,) = compare(load_rows(str(tmp_path)))
    m = cell["metrics"]
    assert m["hit_tokens"]["best_share"] == 0.1 and m["hit_tokens"]["unified_vs_best"] == pytest.approx(800 / 700)
    assert m["hit_tokens"]["unified_vs_default"] == pytest.approx(800 / 500)
    # lower is better: the best split is the smallest, and the ratio is split / unified
    assert m["ttft_mean_s"]["best_share"] == 0.3 and m["ttft_mean_s"]["unified_vs_best"] == pytest.approx(0.15 / 0.10)
    assert m["prefill_tokens_computed"]["best_split"] == 300 and m["sim_seconds"]["best_split"] == 55.0
    assert m["sim_seconds"]["default_split"] == 80.0 and cell["requests"] == 120
    assert cell["of_bound"] == {"unified": 800 / 900, "default_split": 500 / 900, "best_split": 700 / 900,
                                "best_share": 0.1}
    assert cell["repeats_stems"] == {"unified": "2/2, 3/3", "default_split": "1/2, 3/3", "best_split": "1/2, 3/3"}
    md = main(str(tmp_path))
    assert "| agent | 1 | 8192 KiB | 88.9% | 55.6% | 77.8% (0.1) | 2/2, 3/3 | 1/2, 3/3 | 1/2, 3/3 |" in md
    assert "| agent | 1 | 8192 KiB | 120 (110) | hit_tokens | 800 | 500 | 700 (0.1) | 1.143x | 1.600x |" in md
    assert (tmp_path / "arenas.json").exists()


def test_a_cell_without_a_unified_or_default_row_is_left_out(tmp_path):
    write(tmp_path, "unified_agent", [row(None, 800, 200, 0.1, 50.0, seed=1)], unified=True)
    write(tmp_path, "split_default_agent", [row(DEFAULT_STATE_FRACTION, 500, 500, 0.4, 80.0, seed=2)])
    assert compare(load_rows(str(tmp_path))) == []


def test_state_fraction_sizes_the_split_pools_and_is_recorded():
    spec = TraceSpec(mix=(("agent", 1.0),), roots=2, duration=10.0, tool_prefix_len=64, task_len=(8, 16),
                     agent_steps=(2, 3), tool_result=(4, 8), agent_answer=(2, 4), seed=5)
    roots, model = make_trace(spec), StandInModel()
    base = ("--chunk-size", "64", "--track-interval", "64")
    default = run_one(args_for(*base, "--split-pools"), model, parse_policy("valued"), roots, 2 << 20)
    small = run_one(args_for(*base, "--state-fraction", "0.1"), model, parse_policy("valued"), roots, 2 << 20)
    unified = run_one(args_for(*base, "--unified"), model, parse_policy("valued"), roots, 2 << 20)
    assert default["state_fraction"] == DEFAULT_STATE_FRACTION and small["state_fraction"] == 0.1
    assert unified["state_fraction"] is None and unified["unified"] and not small["unified"]
    assert small["slots_total"] < default["slots_total"] and small["pages_total"] > default["pages_total"]
    assert small["_outputs"] == default["_outputs"] == unified["_outputs"]  # the share moves memory, not tokens
    assert 0 < small["hit_tokens"] and 0 < default["hit_tokens"]
