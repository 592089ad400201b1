"""P9: on tp2 rank graphs every all-reduce that feeds P7's residual add + AttnRes + RMSNorm becomes one
k3.all_reduce_attn_res_norm node (exact counts), the block-boundary sites (P7's delta=None fold, where the
all-reduced output is P7's x) included; run over gloo, each rank's graph computes what it did before the
pass. A whole-model graph has no all-reduce: 0 matches."""
import math

import pytest
import torch

from k3compile.passes.kernels import all_reduce_norm  # noqa: F401  (registers the fused op)

from .helpers import graph, layer_counts
from .parallel_helpers import assert_same_over_gloo, count, passes_before, rank_graphs, run_passes

FUSED = torch.ops.k3.all_reduce_attn_res_norm.default
FUSED_F32 = torch.ops.k3.all_reduce_attn_res_norm_f32.default
ALL_REDUCE = torch.ops.k3.all_reduce.default
P9 = "p09_all_reduce_norm"


def _expected(cfg) -> int:
    n = layer_counts(cfg)
    return n["layers"] + n["dense"] + (0 if cfg.latent_size is not None else n["moe"])


_captured = {}


def _rank_graphs(name, mode):
    if (name, mode) not in _captured:  # capturing two ranks is the slow part: once per module
        _captured[name, mode] = rank_graphs(name, mode, P9)
    return _captured[name, mode]


def _block_boundaries(cfg) -> int:
    """Sites whose P7 node took the zeros_like fold: the attention-side read after each AttnRes block boundary."""
    return 0 if cfg.attn_res_block_size is None else math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size)


def _fused_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (FUSED, FUSED_F32)]


@pytest.mark.parametrize("name,mode", [("k3-tiny", "decode"), ("kimi-linear-tiny", "prefill")])
def test_counts_and_numerics_on_tp2_rank_graphs(name, mode):
    cfg, graphs = _rank_graphs(name, mode)
    for before, after, matches, _ in graphs:
        assert matches == _expected(cfg)  # k3-tiny: 9 mixers + 1 dense = 10; kimi-linear-tiny: 6 + 1 + 5 MoE = 12
        fused = _fused_nodes(after)
        assert len(fused) == matches
        # k3-tiny: layers 0, 4 and 8 open a block (the mixer's all-reduce is P7's x, no residual operand)
        assert sum(n.args[1] is None for n in fused) == _block_boundaries(cfg) == (3 if name == "k3-tiny" else 0)
        assert count(after, ALL_REDUCE) == count(before, ALL_REDUCE) - matches
    assert_same_over_gloo(graphs)


def test_single_graph_has_nothing_to_fuse():
    gm = graph("k3-tiny", "decode", torch.float32)
    run_passes(gm, passes_before(P9), "decode")
    assert run_passes(gm, [P9], "decode")[P9] == 0


@pytest.fixture
def gloo_world1():
    import torch.distributed as dist

    from k3compile.model_def.parallel import comm
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm.register_groups(world=dist.group.WORLD)
    yield
    comm.clear_groups()
    dist.destroy_process_group()  # forked ranks of later tests must not inherit it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collective_ops_equal_the_all_reduce_then_the_norm(gloo_world1, dtype):
    g = torch.Generator().manual_seed(0)
    x, part, *bank = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(4))
    query, weight = torch.randn(64, generator=g), torch.randn(64, generator=g).to(dtype)
    tail = (query, weight, 1e-5, 1e-6)
    for x_arg in (x, None):  # None: a block boundary, p = the reduced sum itself
        ref_args = (bank, part, None, *tail) if x_arg is None else (bank, x, part, *tail)
        got = torch.ops.k3.all_reduce_attn_res_norm(bank, x_arg, part.clone(), *tail, "world")
        assert all(torch.equal(a, b) for a, b in zip(got, torch.ops.k3.attn_res_norm(*ref_args)))
        if dtype == torch.float32:
            continue  # P7 emits the _f32 variant only where h is not fp32 already (its h.float() would alias h)
        got = torch.ops.k3.all_reduce_attn_res_norm_f32(bank, x_arg, part.clone(), *tail, "world")
        assert len(got) == 3 and got[2].dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(got, torch.ops.k3.attn_res_norm_f32(*ref_args)))


def test_partial_that_something_else_reads_is_left_alone():
    """The collective overwrites its input, so an all-reduce whose input has another reader is not fused."""
    from k3compile.passes.graph_utils import set_meta_val
    from k3compile.passes.manager import snapshot
    cfg, graphs = _rank_graphs("kimi-linear-tiny", "prefill")
    gm = snapshot(graphs[0][0])  # before P9
    reduce = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ALL_REDUCE
                  and any(u.target == torch.ops.k3.attn_res_norm.default for u in n.users))
    with gm.graph.inserting_after(reduce):
        reader = gm.graph.call_function(torch.ops.aten.neg.default, (reduce.args[0],))  # a 2nd reader of the output
    set_meta_val(reader)
    assert run_passes(gm, [P9], "prefill")[P9] == _expected(cfg) - 1
