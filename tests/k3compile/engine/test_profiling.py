"""engine/profiling + provenance: node ranges and exact costs in the trace; layers and passes per node."""
import gzip
import json

import torch
from k3compile.engine.profiling import TRACE_KEY, AttributionRun, aten_flops, node_cost, profile_steps
from k3compile.engine.provenance import node_layers, node_provenance
from k3compile.passes.manager import PASS_META


def _graph():
    """x @ W3 -> relu -> @ W_head, as an ATen graph with weights named like captured ones."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.w_model_layers_3_proj = torch.nn.Parameter(torch.randn(8, 16))
    m.w_lm_head_weight = torch.nn.Parameter(torch.randn(16, 4))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    h = g.create_node("call_function", torch.ops.aten.mm.default, (x, g.get_attr("w_model_layers_3_proj")), name="mm")
    h = g.create_node("call_function", torch.ops.aten.relu.default, (h,), name="relu")
    g.output(g.create_node("call_function", torch.ops.aten.mm.default, (h, g.get_attr("w_lm_head_weight")),
                           name="mm_1"))
    gm = torch.fx.GraphModule(m, g)
    return gm, gm


def test_layers_and_passes():
    gm, _ = _graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    nodes["relu"].meta[PASS_META] = "p99_example"
    assert node_layers(gm) == {"x": "inputs", "w_model_layers_3_proj": "L3", "mm": "L3", "relu": "L3",
                               "w_lm_head_weight": "head", "mm_1": "head", "output": "head"}
    prov = node_provenance(gm)
    assert prov["relu"] == {"op": "aten.relu.default", "layer": "L3", "pass": "p99_example"}
    assert prov["mm"] == {"op": "aten.mm.default", "layer": "L3", "pass": "capture"}


def test_costs_of_aten_and_gather_ops():
    x, w = torch.randn(2, 8), torch.randn(8, 16)
    out = x @ w
    assert aten_flops(torch.ops.aten.mm.default, (x, w), {}, out) == 2 * 2 * 8 * 16
    assert aten_flops(torch.ops.aten.relu.default, (x,), {}, x) == 0
    assert node_cost(torch.ops.aten.mm.default, (x, w), {}, out, 2 * 2 * 8 * 16) == \
        {"bytes": 4 * (16 + 128 + 32), "flops": 512, "exact": True}
    table, ids = torch.randn(100, 8), torch.tensor([3, 5])
    rows = torch.ops.aten.embedding.default(table, ids)
    assert node_cost(torch.ops.aten.embedding.default, (table, ids), {}, rows, 0)["bytes"] == 2 * 8 * 4 + 2 * 8


def test_profile_steps_writes_node_ranges_and_table(tmp_path):
    gm, m = _graph()
    x = torch.randn(2, 8)
    path = str(tmp_path / "t.json.gz")
    with torch.no_grad():
        profile_steps(lambda: m(x), 2, path, "cpu", attribution=[AttributionRun("cpu", gm, (x,))])
    doc = json.loads(gzip.decompress(open(path, "rb").read()))
    names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert {"k3.attribution#0", "k3.node/mm", "k3.node/relu", "k3.node/mm_1",
            "decode_step#0", "decode_step#1"} <= set(names)
    (table,) = doc[TRACE_KEY]["attribution"]
    assert table["range"] == "k3.attribution#0" and doc[TRACE_KEY]["peaks"] == {}
    mm = table["nodes"]["mm"]
    assert (mm["layer"], mm["flops"], mm["bytes"]) == ("L3", 2 * 2 * 8 * 16, 4 * (16 + 128 + 32))
