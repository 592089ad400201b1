"""Graph JSON: every argument kind a captured step holds survives the round trip; anything outside the
whitelist is refused at write or read time."""
import json
import operator

import pytest
import torch
import torch.fx

from k3compile.engine.graph_io import GraphFormatError, graph_from_dict, graph_to_dict

aten = torch.ops.aten
INPUTS = ("x", "ids")


def sample_graph():
    g = torch.fx.Graph()
    x, ids = g.placeholder("x"), g.placeholder("ids")
    w = g.get_attr("w_proj")
    n = g.call_function(aten.sym_size.int, (x, 0))
    n2 = g.call_function(operator.mul, (n, 2))
    h = g.call_function(aten.mm.default, (x, w))
    h = g.call_function(aten._to_copy.default, (h,), {"dtype": torch.float64, "layout": torch.strided,
                                                       "device": torch.device("cpu"),
                                                       "memory_format": torch.contiguous_format})
    h = g.call_function(aten.clamp.default, (h, float("-inf"), 3.5))
    top = g.call_function(aten.topk.default, (h, 2))
    vals, idx = g.call_function(operator.getitem, (top, 0)), g.call_function(operator.getitem, (top, 1))
    z = g.call_function(aten.new_zeros.default, (vals, [n2, 2]), {"dtype": torch.float32})
    emb = g.call_function(aten.embedding.default, (w, ids))
    g.output((vals, idx, z, emb, g.call_function(aten.sum.dim_IntList, (h, [1], True))))
    return torch.fx.GraphModule({"w_proj": torch.randn(4, 6)}, g)


def test_round_trip_is_exact_and_pickle_free():
    gm = sample_graph()
    d = graph_to_dict(gm, "decode", {"w_proj": "w_proj"})
    text = json.dumps(d, allow_nan=False)  # plain JSON: no pickle, no NaN/Infinity literals
    back = graph_from_dict(json.loads(text), {"w_proj": gm.w_proj}, INPUTS)
    x, ids = torch.randn(5, 4), torch.tensor([0, 3])
    for a, b in zip(gm(x, ids), back(x, ids)):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert [n.op for n in back.graph.nodes] == [n.op for n in gm.graph.nodes]


def test_device_constants_follow_the_load_device():
    d = graph_to_dict(sample_graph(), "decode", {"w_proj": "w_proj"})
    back = graph_from_dict(d, {"w_proj": torch.randn(4, 6)}, INPUTS, device=torch.device("meta"))
    copy = next(n for n in back.graph.nodes if n.target is aten._to_copy.default)
    assert copy.kwargs["device"] == torch.device("meta")


def test_unsupported_graphs_are_refused_when_written():
    gm = sample_graph()
    node = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    node.target = torch.matmul  # a Python callable, not an op overload
    with pytest.raises(GraphFormatError, match="only torch op overloads"):
        graph_to_dict(gm, "decode", {"w_proj": "w_proj"})
    gm = sample_graph()
    node = next(n for n in gm.graph.nodes if n.target is aten.clamp.default)
    node.args = (node.args[0], object(), 3.5)
    with pytest.raises(GraphFormatError, match="node clamp_default: argument of type object"):
        graph_to_dict(gm, "decode", {"w_proj": "w_proj"})


def _dict():
    return graph_to_dict(sample_graph(), "decode", {"w_proj": "w_proj"})


def _load(d):
    return graph_from_dict(d, {"w_proj": torch.randn(4, 6)}, INPUTS)


def test_names_from_the_file_never_reach_generated_code_verbatim():
    d = _dict()
    d["nodes"][2]["name"] = "w; import os; os.system('exit 1')"
    for n in d["nodes"][3:]:  # keep references consistent
        n["args"] = json.loads(json.dumps(n["args"]).replace('"w_proj"', json.dumps(d["nodes"][2]["name"])))
    gm = _load(d)
    assert "import os" not in gm.code


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["nodes"][5]["kwargs"].update({"x=1); import os; (y": 1}), "not identifiers"),
    (lambda d: d["nodes"][1].update(target="input_ids"), "is not step input #1"),
    (lambda d: d["nodes"][4].update(args=[{"node": "nope"}]), "refers to node 'nope'"),
    (lambda d: d["nodes"][5]["kwargs"].update(dtype={"dtype": "float128"}), "bad dtype value"),
    (lambda d: d["nodes"][5]["kwargs"].update(dtype={"pickle": "x"}), "unknown argument tag 'pickle'"),
    (lambda d: d["nodes"].insert(3, {"name": "m", "op": "call_module", "target": "os"}), "call_module.*not allowed"),
    (lambda d: d["nodes"].pop(), "no output node"),
    (lambda d: d.update(format="k3compile.fx-graph/0"), "graph format"),
])
def test_malformed_files_are_refused_when_read(edit, message):
    d = _dict()
    edit(d)
    with pytest.raises(GraphFormatError, match=message):
        _load(d)
