"""The captured verify step (speculative decoding): stored and reloaded through the engine's graph format,
it computes the eager model's verify logits and fills the same draft window (k3-tiny, fp32, no passes)."""
import torch

from k3compile.engine.emit import collect_weights
from k3compile.engine.graph_io import graph_from_dict, graph_to_dict
from k3compile.model_def.batch import ForwardBatch, step_args
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec, step_input_names
from tests.passes.helpers import graph, model as cached_model


def test_verify_graph_round_trip_matches_the_model():
    # the pass tests' capture (P16's test captures the same graph; tests/conftest.py runs both files in one worker)
    model, gm = cached_model("k3-tiny"), graph("k3-tiny", "verify")
    weights, keys = collect_weights({"verify": gm})
    loaded = graph_from_dict(graph_to_dict(gm, "verify", keys["verify"]), weights, step_input_names("verify"))
    spec = model.cache_spec()
    caches = [CacheTensors.allocate(spec, 4, 8, 4) for _ in range(2)]
    pre = ForwardBatch.build("prefill", [[3, 4, 5, 6, 7], [8, 9]], [0, 0], [[1, 2], [3, 4]], [1, 2], 4)
    for c in caches:
        model.step(pre, c)
    vb = ForwardBatch.build("verify", [[1, 2, 3], [4, 5, 6]], [5, 2], [[1, 2], [3, 4]], [1, 2], 4, logits="all")
    wins = [DraftWindow.allocate(DraftWindowSpec(spec, 3), 2) for _ in range(2)]
    want = model.step(vb, caches[0], wins[0])
    with torch.no_grad():
        got = loaded(*step_args(vb, caches[1]), *wins[1].tensors())
    assert torch.equal(got, want)
    for a, b in zip(wins[0].tensors(), wins[1].tensors()):
        assert torch.equal(a, b)
    assert torch.equal(caches[0].ssm, caches[1].ssm) and torch.equal(caches[0].kv, caches[1].kv)
