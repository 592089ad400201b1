"""Speculative verify under DCP (gloo): n query tokens per request, each attending causally over the positions
before it, every DCP rank over its own shard of them, partial outputs + LSEs exchanged and merged exactly. The
verify logits of every token, and the decode step after committing an accepted prefix, match the single
process within fp32 tolerance (k3-tiny, 8-head variant; dcp2 and tp2-dcp2, eager, and dcp2 through the
captured verify graph that `build --topology dcp2 --verify-graphs` puts in each rank engine)."""
import pytest
import torch

from k3compile.capture import capture_step
from k3compile.model_def.batch import ForwardBatch, step_args
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec, commit_reference
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, parse_topology
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import launch

from .helpers import PAGE, whole_model, wide_config

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 41, 9], [260, 4, 33, 12, 90]]
DRAFTS = [[21, 22, 23, 24], [31, 32, 33, 34]]  # anchor + 3 drafts per request
ACCEPT = [2, 4]


def verify_then_decode(model, kv_shard=None, verify_graph=None):
    """(verify logits [B*n, V], decode logits [B, V] after committing ACCEPT) from whole prompts; the verify
    step through `verify_graph` (the captured verify step of `model`) when given."""
    m = 1 if kv_shard is None else kv_shard[1]
    b, n = len(PROMPTS), len(DRAFTS[0])
    pages = -(-(-(-(max(map(len, PROMPTS)) + n + 1) // m)) // PAGE)
    cache = CacheTensors.allocate(model.cache_spec(torch.float32), b + 1, b * pages + 1, PAGE, "cpu")
    rows = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(b)]
    slots = list(range(1, b + 1))

    def batch(mode, toks, prefix, logits="last"):
        return ForwardBatch.build(mode, toks, prefix, rows, slots, PAGE, logits=logits, kv_shard=kv_shard)

    lens = [len(p) for p in PROMPTS]
    with torch.no_grad():
        model.step(batch("prefill", PROMPTS, [0] * b), cache)
        window = DraftWindow.allocate(DraftWindowSpec(model.cache_spec(torch.float32), n, "replay"), b)
        vb = batch("verify", DRAFTS, lens, logits="all")
        if verify_graph is None:
            verify = model.step(vb, cache, window)
        else:
            verify = verify_graph(*step_args(vb, cache), *window.tensors())
        commit_reference(cache, window, slots, ACCEPT)
        lens = [s + a for s, a in zip(lens, ACCEPT)]
        decode = model.step(batch("decode", [[50], [51]], lens), cache)
    return verify, decode


def _rank(rank, cfg, topology, captured):
    topo = parse_topology(topology)
    init_rank(topo, "gloo", timeout_s=60)
    try:
        shard = RankShard.of(cfg, topo, rank)
        model = shard_model(whole_model(cfg), shard)
        graph = capture_step(model, "verify") if captured else None
        return verify_then_decode(model, (shard.dcp_rank, shard.dcp), graph)
    finally:
        shutdown_rank()


@pytest.mark.parametrize("topology,captured", [("dcp2", False), ("tp2-dcp2", False), ("dcp2", True)],
                         ids=["dcp2-eager", "tp2-dcp2-eager", "dcp2-captured-graph"])
def test_verify_under_dcp_matches_single_process(topology, captured):
    cfg = wide_config("k3-tiny")
    ref_verify, ref_decode = verify_then_decode(whole_model(cfg))
    for rank, (verify, decode) in enumerate(launch(_rank, parse_topology(topology).world, (cfg, topology, captured),
                                                   timeout_s=180)):
        for what, got, want in (("verify", verify, ref_verify), ("decode", decode, ref_decode)):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-4, f"rank {rank} {what}: max rel err {err:.2e}"
        assert torch.equal(verify.argmax(-1), ref_verify.argmax(-1))
