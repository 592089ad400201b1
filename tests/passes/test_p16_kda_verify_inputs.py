"""P16 ReplaySSM window inputs: one k3.kda_verify_inputs per KDA layer in verify graphs (none in
verify_snapshot, decode or prefill graphs), right after its kda_verify, the gate variant read off the
graph (both the add form and P11's addmm form of the forget input), and a CPU verify + commit that is
bit for bit what the graph without P16 gives: on CPU the op runs the reference arithmetic, the same
torch ops the verify graph runs, so torch.equal is the right check here (on CUDA the window is P5's
arithmetic instead: test_p16_gpu.py)."""
import functools

import pytest
import torch

from k3compile.engine.emit import collect_weights
from k3compile.engine.graph_io import graph_from_dict, graph_to_dict
from k3compile.model_def.batch import ForwardBatch, step_args
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec, step_input_names
from k3compile.model_def.ops.kda_launch import LAYOUTS
from k3compile.passes.kernels import kda_verify_inputs  # noqa: F401  (torch.ops.k3.kda_verify_inputs)
from k3compile.passes.manager import PassManager, snapshot
from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.registry import PassConfigError
from k3compile.runtime.spec.fold_kernel import commit

from .helpers import MODELS, graph, model, op_counts, run_pass

P16 = "p16_kda_verify_inputs"
OP = torch.ops.k3.kda_verify_inputs.default
KDA_VERIFY = torch.ops.k3.kda_verify.default


@functools.lru_cache(maxsize=None)
def _upstream_cached(name: str, dtype):
    gm = graph(name, "verify", dtype)
    cfg = PipelineConfig.default()
    cfg.order = [n for n in cfg.order if n != P16]
    PassManager(cfg).run(gm, None)
    return gm


def _upstream(name: str, dtype=torch.float32):
    """A private copy of the verify graph after every other pass of the default pipeline (what P16 sees)."""
    return snapshot(_upstream_cached(name, dtype))


def test_p16_is_in_the_default_pipeline_after_p11():
    order = PipelineConfig.default().order
    assert P16 in order and order.index(P16) > order.index("p11_copy_elision")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_op_per_kda_layer_in_verify_graphs(name, dtype):
    cfg = model(name).config
    n_kda = len(cfg.kda_layers)
    gm = _upstream(name, dtype)
    before = op_counts(gm)
    assert before[OP] == 0 and before[KDA_VERIFY] == n_kda
    assert run_pass(gm, P16) == n_kda
    after = op_counts(gm)
    assert after[OP] == n_kda and after[KDA_VERIFY] == n_kda  # nothing erased: kda_verify still computes o
    ops = [n for n in gm.graph.nodes if n.target == OP]
    assert [n.args[9] for n in ops] == list(range(n_kda))
    for n in ops:
        assert n.prev.target == KDA_VERIFY and n.prev.args[6] == n.args[9]  # right after its layer's kda_verify
        assert n.args[11:15] == n.prev.args[8:12]  # the same window tensors
        assert n.args[15] == cfg.gate_lower_bound
        assert n.args[16] == "s8"  # P5's default launch layout, whose blocks the kernel reproduces
        # fp32: P11 folded dt_bias into f_b_proj's GEMM (addmm), so f carries it; bf16: the fp32 add stays
        assert (n.args[5] is None) == (dtype == torch.float32)
        if dtype == torch.float32:
            assert n.args[4].target == torch.ops.aten.addmm.default


def test_launch_layout_is_recorded_and_must_be_p5s(monkeypatch):
    cfg = PipelineConfig.default()
    cfg.set_option(P16, "launch", "wide")  # dropped after session 9's H200 run (model_def/ops/kda_launch.py)
    with pytest.raises(PassConfigError, match="p16_kda_verify_inputs: launch must be one of s8, got 'wide'"):
        cfg.validate()
    # s8 is the only layout: a second name for its rule, for this test only, shows the name is recorded and
    # that P5 and P16 must agree on it
    monkeypatch.setitem(LAYOUTS, "s8-again", LAYOUTS["s8"])
    gm = _upstream(MODELS[0])
    run_pass(gm, P16, launch="s8-again")
    assert {n.args[16] for n in gm.graph.nodes if n.target == OP} == {"s8-again"}
    cfg.set_option(P16, "launch", "s8-again")
    with pytest.raises(PassConfigError, match="p05_fused_kda_decode.launch = 's8' but p16_kda_verify_inputs.launch"):
        cfg.validate()
    cfg.set_option("p05_fused_kda_decode", "launch", "s8-again")
    cfg.validate()


@pytest.mark.parametrize("name", MODELS)
def test_matches_the_captured_verify_graph(name):
    """Without upstream passes (the add form of the forget input, fp32)."""
    gm = graph(name, "verify")
    assert run_pass(gm, P16) == len(model(name).config.kda_layers)
    assert all(n.args[5] is not None for n in gm.graph.nodes if n.target == OP)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["verify_snapshot", "decode", "prefill"])
def test_no_match_outside_verify_graphs(name, mode):
    gm = graph(name, mode)
    nodes = len(gm.graph.nodes)
    assert run_pass(gm, P16) == 0
    assert len(gm.graph.nodes) == nodes


def _verify_and_commit(gm, m, dtype, seed=0):
    """A verify step of 3 requests x 4 tokens over random pools, then a commit: (logits, window, pools)."""
    spec = m.cache_spec()
    gen = torch.Generator().manual_seed(seed)
    cache = CacheTensors.allocate(spec, 6, 12, 4)
    for t in (cache.ssm, cache.conv, cache.kv):
        t.copy_((torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype))
    ids = torch.randint(0, m.config.vocab_size, (3, 4), generator=gen).tolist()
    slots = [4, 1, 2]
    batch = ForwardBatch.build("verify", ids, [5, 2, 9], [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]], slots, 4,
                               logits="all")
    window = DraftWindow.allocate(DraftWindowSpec(spec, 4), 4)
    with torch.no_grad():
        logits = gm(*step_args(batch, cache), *window.tensors())
    out = [logits, *window.tensors()]
    commit(cache, window, slots, [4, 1, 3], use_kernel=False)
    return out + [cache.ssm, cache.conv, cache.kv]


@pytest.mark.parametrize("name,dtype", [("k3-tiny", torch.float32), ("kimi-linear-tiny", torch.bfloat16)])
def test_cpu_verify_and_commit_are_unchanged_bit_for_bit(name, dtype):
    m = model(name, dtype)
    before = _upstream(name, dtype)
    after = snapshot(before)
    assert run_pass(after, P16) == len(m.config.kda_layers)
    # and through the engine's graph format (the op, its None / float arguments)
    weights, keys = collect_weights({"verify": after})
    loaded = graph_from_dict(graph_to_dict(after, "verify", keys["verify"]), weights, step_input_names("verify"))
    want = _verify_and_commit(before, m, dtype)
    for gm in (after, loaded):
        got = _verify_and_commit(gm, m, dtype)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"tensor {i} differs"
