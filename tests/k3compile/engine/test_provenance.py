"""Node provenance on a real engine: the pass behind each node survives save/load, layers follow the weights."""
from collections import Counter

import pytest

from k3compile.engine import Engine
from k3compile.engine.provenance import CAPTURED, node_provenance


@pytest.fixture(scope="module")
def tiny(built_engine):
    return built_engine("k3-tiny")


def test_pass_and_layer_of_every_node_round_trip(tiny):
    built, path = tiny
    mem = node_provenance(built.graphs["decode"])
    loaded = node_provenance(Engine.load(path).graphs["decode"])
    assert loaded == mem
    fused = [p for p in mem.values() if p["op"] == "k3.fused_route.default"]
    assert len(fused) == 8 and {p["pass"] for p in fused} == {"p04_fused_routing"}
    assert {p["pass"] for p in mem.values() if p["op"] == "k3.fused_kda_decode.default"} == {"p05_fused_kda_decode"}
    assert {p["pass"] for p in mem.values() if p["op"] == "k3.mla_decode_fused_out.default"} == {"p15_mla_decode"}
    by_pass = Counter(p["pass"] for p in mem.values())
    assert by_pass["p01_gemm_merge"] > 0
    # one recurrent or attention core per layer: together they cover the 9 layers once each
    cores = [p["layer"] for p in mem.values()
             if p["op"] in ("k3.fused_kda_decode.default", "k3.mla_decode_fused_out.default")]
    assert sorted(cores, key=lambda s: int(s[1:])) == [f"L{i}" for i in range(9)]
    assert {p["layer"] for p in mem.values() if p["op"] == "aten.embedding.default"} == {"embed"}
