"""One GPU, NCCL with world size 1, through the same code paths as the gloo tests: the k3 collectives, a
rank model (shard of world 1, so every all-reduce / all-gather runs through NCCL) against the whole
model, the DCP partial attention on CUDA, and P9's collective op (the CPU composite on CUDA tensors)."""
import os

import pytest
import torch
import torch.distributed as dist

from k3compile.model_def.parallel import comm
from k3compile.model_def.parallel.dcp_attention import latent_partial
from k3compile.model_def.parallel.lse_merge import merge_partials
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, Topology
from k3compile.model_def.ops.attention_math import mla_decode_latent
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import free_port

from .helpers import greedy, whole_model, wide_config

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
    g = torch.Generator(device="cuda").manual_seed(0)
    page, r, w, dcp, seq = 16, 512, 576, 4, [1, 7, 300]
    pages_per = 32
    q = torch.randn(len(seq), 16, w, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.zeros(1 + len(seq) * pages_per, page, w, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[1 + i * pages_per + j for j in range(pages_per)] for i in range(len(seq))], device="cuda")
    rows = [torch.randn(n, w, device="cuda", generator=g, dtype=torch.bfloat16) for n in seq]
    for i, x in enumerate(rows):
        kv.view(-1, w)[table[i, 0] * page: table[i, 0] * page + len(x)] = x
    seq_t = torch.tensor(seq, device="cuda")
    full = mla_decode_latent(q.float(), kv.float(), table, seq_t, 192 ** -0.5, r)
    cu = torch.arange(len(seq) + 1, device="cuda")
    outs, lses = [], []
    for d in range(dcp):
        local = torch.zeros_like(kv)
        for i, x in enumerate(rows):
            mine = x[d::dcp]
            local.view(-1, w)[table[i, 0] * page: table[i, 0] * page + len(mine)] = mine
        o, lse = latent_partial(q.float(), local.float(), table, cu, seq_t, 192 ** -0.5, r, d, dcp)
        outs.append(o)
        lses.append(lse)
    merged, _ = merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.allclose(merged, full, atol=1e-4, rtol=1e-4)


def test_p9_collective_op_on_cuda(nccl_world1):
    from k3compile.passes.kernels import all_reduce_norm  # noqa: F401
    g = torch.Generator(device="cuda").manual_seed(1)
    x, part = (torch.randn(8, 2048, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    bank = [torch.randn(8, 2048, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    query = torch.randn(2048, device="cuda", generator=g)
    weight = torch.randn(2048, device="cuda", generator=g, dtype=torch.bfloat16)
    h, p = torch.ops.k3.all_reduce_attn_res_norm(bank, x, part, query, weight, 1e-5, 1e-5, "world")
    h_ref, p_ref = torch.ops.k3.attn_res_norm(bank, x, part, query, weight, 1e-5, 1e-5)
    assert torch.equal(p, p_ref) and torch.allclose(h.float(), h_ref.float(), atol=1e-2, rtol=1e-2)
