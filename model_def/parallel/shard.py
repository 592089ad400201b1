"""One rank's model: the module tree with this rank's sizes, and its weights cut from the whole model's.

Slicing needs no per-name table: the rank model's own shapes say which dimension is split and how
many ways. A dimension split world-ways takes the rank's block; one split tp-ways (MLA queries under
DCP) takes its query group's block. The only special case is the stacked gate|up expert weight
(w13, rows [0, I) gate and [I, 2I) up), whose intermediate slice is taken from both halves.
"""
from __future__ import annotations

import torch

from ..model import K3ForCausalLM
from .topology import RankShard, TopologyError

_GATE_UP_STACKED = ("experts.w13", "experts.w13_packed", "experts.w13_scale")


def build_rank_model(cfg, shard: RankShard, dtype=torch.float32, device="cpu") -> K3ForCausalLM:
    """Rank model with uninitialized storage (meta: shapes only, what the planner counts)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, shard)
    model = model.to(dtype=dtype)
    if str(device) != "meta":
        model = model.to_empty(device=device)
        for mod in model.modules():  # buffers (router bias) stay fp32, as loader.build_model keeps them
            for name, buf in list(mod.named_buffers(recurse=False)):
                mod.register_buffer(name, torch.zeros(buf.shape, dtype=torch.float32, device=device))
    return model.eval().requires_grad_(False)


def slice_tensor(name: str, full: torch.Tensor, local_shape, shard: RankShard) -> torch.Tensor:
    """The rank's part of one whole-model tensor `name`, of shape `local_shape`."""
    if tuple(full.shape) == tuple(local_shape):
        return full
    dims = [i for i, (a, b) in enumerate(zip(full.shape, local_shape)) if a != b]
    if len(full.shape) != len(local_shape) or len(dims) != 1 or full.shape[dims[0]] % local_shape[dims[0]]:
        raise TopologyError(f"{name}: cannot cut a rank's {tuple(local_shape)} out of {tuple(full.shape)}")
    dim = dims[0]
    ways = full.shape[dim] // local_shape[dim]
    if any(name.endswith(s) for s in _GATE_UP_STACKED) and dim == 1:  # [E, 2I, W]: slice gate and up alike
        half = full.shape[1] // 2
        gate, up = full.narrow(1, 0, half), full.narrow(1, half, half)
        return torch.cat([slice_tensor(name + "[gate]", gate, (gate.shape[0], local_shape[1] // 2) + tuple(gate.shape[2:]), shard),
                          slice_tensor(name + "[up]", up, (up.shape[0], local_shape[1] // 2) + tuple(up.shape[2:]), shard)], 1)
    if ways == shard.world:
        index = shard.rank
    elif ways == shard.topology.tp:
        index = shard.query_group
    else:
        raise TopologyError(f"{name}: split {ways} ways, but {shard.topology.name} splits {shard.world} or "
                            f"{shard.topology.tp} ways")
    n = local_shape[dim]
    return full.narrow(dim, index * n, n)


@torch.no_grad()
def shard_model(full: K3ForCausalLM, shard: RankShard) -> K3ForCausalLM:
    """The rank model of `shard` with its weights cut from the whole (loaded) model `full`."""
    dtype = full.lm_head.weight.dtype
    local = build_rank_model(full.config, shard, dtype, full.lm_head.weight.device)
    whole = full.state_dict()
    for name, t in local.state_dict().items():
        if name not in whole:
            raise TopologyError(f"rank model tensor {name} has no counterpart in the whole model")
        t.copy_(slice_tensor(name, whole[name], t.shape, shard))
    return local
