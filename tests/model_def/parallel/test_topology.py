"""Topology strings, which rank holds what, and clear errors for splits a model cannot take."""
import pytest

from k3compile.model_def.config import get_preset
from k3compile.model_def.parallel.shard import build_rank_model
from k3compile.model_def.parallel.topology import RankShard, Topology, TopologyError, parse_topology


@pytest.mark.parametrize("text,tp,dcp,experts,name", [
    ("single", 1, 1, "auto", "single"), ("tp8", 8, 1, "auto", "tp8"), ("tep4", 4, 1, "ep", "tep4"),
    ("dcp8", 1, 8, "auto", "dcp8"), ("tp2-dcp4", 2, 4, "auto", "tp2-dcp4"), ("TP3-DCP5", 3, 5, "auto", "tp3-dcp5"),
    ("tep2-dcp2", 2, 2, "ep", "tep2-dcp2"),
])
def test_parse(text, tp, dcp, experts, name):
    t = parse_topology(text)
    assert (t.tp, t.dcp, t.experts, t.name, t.world) == (tp, dcp, experts, name, tp * dcp)


@pytest.mark.parametrize("bad", ["", "tp", "tp0", "dcp", "pp2", "tp2-pp2", "-dcp2", "tp2dcp2x", "tp-2"])
def test_parse_errors_name_the_input(bad):
    with pytest.raises(TopologyError, match="topology"):
        parse_topology(bad)


def test_rank_coordinates_and_blocks():
    cfg = get_preset("k3")
    s = RankShard.of(cfg, parse_topology("tp2-dcp4"), 6)
    assert (s.query_group, s.dcp_rank, s.expert_mode) == (1, 2, "ep")
    assert s.block(96) == range(72, 84)  # own KDA heads / MLA output heads: block 6 of 8
    assert s.query_block(96) == range(48, 96)  # MLA queries of query group 1 of 2
    assert s.expert_block(896) == range(672, 784)
    assert s.dcp_group_ranks() == [4, 5, 6, 7]
    assert [p for p in range(12) if s.owns_position(p)] == [2, 6, 10]
    assert [s.local_kv_len(n) for n in (0, 2, 3, 7, 11)] == [0, 0, 1, 2, 3]


def test_impossible_splits_are_clear_errors():
    tiny = get_preset("k3-tiny")  # 2 KDA heads, 2 MLA heads, 8 experts
    with pytest.raises(TopologyError, match="2 KDA heads are not divisible by 4 ranks"):
        RankShard.of(tiny, parse_topology("tp4"), 0)
    with pytest.raises(TopologyError, match="rank 2 is outside 0..1"):
        RankShard.of(tiny, parse_topology("dcp2"), 2)
    wide = tiny.replace(kda_num_heads=12, num_attention_heads=12, num_experts=12)
    with pytest.raises(TopologyError, match="12 routed experts do not divide over 8 ranks"):
        RankShard.of(wide.replace(kda_num_heads=8, num_attention_heads=8), parse_topology("tep8"), 0)
    with pytest.raises(TopologyError, match="12 MLA heads are not divisible by 8"):
        RankShard.of(wide.replace(kda_num_heads=8), parse_topology("tp8"), 0)
    # auto placement falls back to sliced experts when whole ones do not divide
    assert RankShard.of(wide, parse_topology("tp4"), 0).expert_mode == "ep"
    assert RankShard.of(wide.replace(num_experts=10), parse_topology("tp4"), 0).expert_mode == "tp"


def test_rank_model_shapes():
    cfg = get_preset("k3")
    m = build_rank_model(cfg, RankShard.of(cfg, Topology(2, 4), 0), device="meta")
    mla = m.model.layers[3].self_attn
    assert mla.q_b_proj.weight.shape == (48 * 192, 1536)  # query group: 96 / 2 heads
    assert mla.o_proj.weight.shape == (7168, 12 * 128)  # own heads: 96 / 8
    assert mla.kv_a_proj_with_mqa.weight.shape == (576, 7168)  # latent KV projection whole
    assert m.model.layers[0].self_attn.q_proj.weight.shape == (12 * 128, 7168)
    assert m.model.layers[1].block_sparse_moe.experts.w13.shape == (112, 2 * 3072, 3584)
    assert m.lm_head.weight.shape == (163840 // 8, 7168)
