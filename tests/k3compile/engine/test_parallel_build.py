"""`build --topology dcp2`: one engine per rank (partitioned, captured, the default passes per rank), the
plan in every manifest; the loaded rank engines, run over gloo, give the single-process greedy tokens."""
import json
import os

import pytest
import torch

from k3compile.engine.build import BuildOptions, build_engine
from k3compile.engine.engine import Engine
from k3compile.engine.format import EngineError
from k3compile.model_def.config import ConfigError, get_preset
from k3compile.model_def.parallel.topology import TopologyError
from k3compile.passes.pipeline import PipelineConfig, pipeline_from_flags
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import launch
from tests.model_def.parallel.helpers import greedy, whole_model


def _run_rank(rank, path):
    engine = Engine.load(path, rank=rank)
    init_rank(engine.topology, "gloo", timeout_s=60)
    try:
        dcp = engine.topology.dcp
        return greedy(engine, kv_shard=(rank % dcp, dcp) if dcp > 1 else None), engine.manifest["passes"]
    finally:
        shutdown_rank()


@pytest.fixture(scope="module")
def dcp2_engine(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("engines") / "dcp2")
    # P7, P9 and P12 only (capturing four graphs is the slow part on a CPU): enough to see passes run per rank
    # and the collective ops they emit saved, loaded and run by the rank engines
    pipeline = pipeline_from_flags(passes="p07_attn_res_norm,p09_all_reduce_norm,p12_moe_finalize_all_reduce")
    build_engine(BuildOptions("k3-tiny", dtype=torch.float32, topology="dcp2", pipeline=pipeline), out,
                 log=lambda msg: None)
    return out


def test_layout_and_plan(dcp2_engine):
    with open(os.path.join(dcp2_engine, "engine.json")) as f:
        top = json.load(f)
    assert top["topology"] == "dcp2" and top["ranks"] == {"0": "rank0", "1": "rank1"}
    assert [p["kv_positions"] for p in top["plan"]] == ["p mod 2 = 0", "p mod 2 = 1"]
    assert [p["kda_heads"] for p in top["plan"]] == [[0, 1], [1, 2]]
    assert [p["experts"] for p in top["plan"]] == [[0, 4], [4, 8]]  # 8 experts: whole ones per rank (EP)
    for r in (0, 1):
        e = Engine.load(dcp2_engine, rank=r)
        assert (e.rank, e.topology.name, e.world) == (r, "dcp2", 2)
        assert e.manifest["parallel"]["plan"] == top["plan"]
        assert e.cache_spec().kda_heads == 1
    with pytest.raises(EngineError, match="dcp2 engine of 2 ranks; each rank process loads its own"):
        Engine.load(dcp2_engine)
    with pytest.raises(EngineError, match="no rank 2"):
        Engine.load(dcp2_engine, rank=2)


def test_rank_engines_match_single_process(dcp2_engine):
    ref_tokens, ref_logits = greedy(whole_model(get_preset("k3-tiny")))
    results = launch(_run_rank, 2, (dcp2_engine,), timeout_s=300)
    for (tokens, logits), passes in results:
        assert torch.equal(tokens, ref_tokens)
        assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4
        for mode in ("decode", "prefill"):
            ran = {p["name"]: p["matches"] for p in passes[mode]["passes"]}
            # 9 mixers + 1 dense MLP end in an all-reduce, and P9 fuses all 10 (the 3 at AttnRes block boundaries,
            # where P7 folds the zero-filled partial sum, included); P12: the 8 latent MoE sums (no P6 here); P7: 2 per
            # layer + layer 0's norm of the embedding
            assert ran == {"p07_attn_res_norm": 19, "p09_all_reduce_norm": 10, "p12_moe_finalize_all_reduce": 8}


def test_impossible_or_unverifiable_builds_are_clear_errors(tmp_path):
    with pytest.raises(TopologyError, match="2 KDA heads are not divisible by 4 ranks"):
        build_engine(BuildOptions("k3-tiny", dtype=torch.float32, topology="tp4"), str(tmp_path / "a"),
                     log=lambda msg: None)
    with pytest.raises(ConfigError, match="without --verify"):
        build_engine(BuildOptions("k3-tiny", dtype=torch.float32, topology="tp2", verify=True,
                                  pipeline=PipelineConfig.default()), str(tmp_path / "b"), log=lambda msg: None)
    with pytest.raises(TopologyError, match="unknown topology 'pp2'"):
        build_engine(BuildOptions("k3-tiny", topology="pp2"), str(tmp_path / "c"), log=lambda msg: None)
    assert not os.path.exists(tmp_path / "a") or not os.listdir(tmp_path / "a")
