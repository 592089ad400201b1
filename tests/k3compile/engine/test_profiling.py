"""engine/profiling + provenance: node ranges and exact costs in the trace; layers and passes per node."""
import gzip
import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.engine.profiling import TRACE_KEY, AttributionRun, node_cost, profile_steps
from k3compile.engine.provenance import node_layers, node_provenance
from k3compile.passes.manager import PASS_META


def _graph():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_model_layers_3_proj = torch.nn.Parameter(torch.randn(8, 16))
            self.w_lm_head_weight = torch.nn.Parameter(torch.randn(16, 4))

        def forward(self, x):
            h = torch.relu(x @ self.w_model_layers_3_proj)
            return h @ self.w_lm_head_weight

    m = M()
    gm = torch.fx.symbolic_trace(m)
    return gm, m


def test_layers_and_passes():
    gm, _ = _graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    nodes["relu"].meta[PASS_META] = "p99_example"
    assert node_layers(gm) == {"x": "inputs", "w_model_layers_3_proj": "L3", "matmul": "L3", "relu": "L3",
                               "w_lm_head_weight": "head", "matmul_1": "head", "output": "head"}
    prov = node_provenance(gm)
    assert prov["relu"] == {"op": "relu", "layer": "L3", "pass": "p99_example"}
    assert prov["matmul"]["pass"] == "capture"


def test_costs_of_aten_and_gather_ops():
    x, w = torch.randn(2, 8), torch.randn(8, 16)
    out = x @ w
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
    assert {"k3.attribution#0", "k3.node/matmul", "k3.node/relu", "k3.node/matmul_1",
            "decode_step#0", "decode_step#1"} <= set(names)
    (table,) = doc[TRACE_KEY]["attribution"]
    assert table["range"] == "k3.attribution#0" and doc[TRACE_KEY]["peaks"] == {}
    mm = table["nodes"]["matmul"]
    assert (mm["layer"], mm["flops"], mm["bytes"]) == ("L3", 2 * 2 * 8 * 16, 4 * (16 + 128 + 32))
