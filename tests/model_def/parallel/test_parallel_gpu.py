"""One GPU, NCCL with world size 1, through the same code paths as the gloo tests: the k3 collectives, a
rank model (shard of world 1, so every all-reduce / all-gather runs through NCCL) against the whole
model, the DCP partial attention on CUDA, and P9's collective op (the CPU composite on CUDA tensors)."""
import os

import pytest
import torch
import torch.distributed as dist

from k3compile.model_def.parallel import comm
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, Topology
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import free_port

from .helpers import dcp_decode_vs_full, greedy, whole_model, wide_config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world1():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    init_rank(Topology(1, 1), "nccl", timeout_s=60, device_id=torch.device("cuda:0"))
    comm.register_groups(dcp=dist.group.WORLD)  # a one-rank DCP group, so all_to_all runs through NCCL too
    yield
    shutdown_rank()


def test_collectives(nccl_world1):
    x = torch.randn(3, 5, device="cuda")
    assert torch.equal(torch.ops.k3.all_reduce(x, "world"), x)
    assert torch.equal(torch.ops.k3.all_gather(x, "world", 1, -1), x)
    assert torch.equal(torch.ops.k3.all_to_all(x.unsqueeze(0), "dcp")[0], x)


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_rank_model_matches_whole_model(nccl_world1, name):
    cfg = wide_config(name)
    whole = whole_model(cfg).cuda()
    ref_tokens, ref_logits = greedy(whole)
    rank = shard_model(whole, RankShard.of(cfg, Topology(1, 1), 0))
    with comm.record() as calls:
        tokens, logits = greedy(rank)
    assert len(calls) > 0 and torch.equal(tokens.cpu(), ref_tokens.cpu())
    assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4


def test_dcp_partials_on_cuda_merge_to_full_decode():
    merged, full, _ = dcp_decode_vs_full([1, 7, 300], 4, heads=16, width=576, rank_r=512, page=16,
                                         scale=192 ** -0.5, device="cuda")
    assert torch.allclose(merged, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_x", [True, False])
def test_p9_collective_op_on_cuda(nccl_world1, with_x):
    """P9's op on CUDA: NCCL in place on the partial, then P7's Triton kernel; against the composite (a fresh
    k3::all_reduce, then the reference norm). with_x False: an AttnRes block boundary (p = the reduced sum)."""
    from k3compile.passes.kernels import all_reduce_norm  # noqa: F401
    from k3compile.passes.kernels.attn_res_norm import attn_res_norm_reference
    g = torch.Generator(device="cuda").manual_seed(1)
    x, part = (torch.randn(8, 2048, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    bank = [torch.randn(8, 2048, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    query = torch.randn(2048, device="cuda", generator=g)
    weight = torch.randn(2048, device="cuda", generator=g, dtype=torch.bfloat16)
    summed = torch.ops.k3.all_reduce(part, "world")
    ref_x, ref_delta = (x, summed) if with_x else (summed, None)
    h_ref, p_ref = attn_res_norm_reference(bank, ref_x, ref_delta, query, weight, 1e-5, 1e-5)
    mine = part.clone()
    h, p, h32 = torch.ops.k3.all_reduce_attn_res_norm_f32(bank, x if with_x else None, mine, query, weight, 1e-5,
                                                          1e-5, "world")
    assert torch.equal(mine, summed)  # reduced in place
    assert torch.equal(p, p_ref) and torch.equal(h32, h.float())
    assert ((h.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item() < 1e-2
