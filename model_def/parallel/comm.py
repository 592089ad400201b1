"""Collectives as `k3::` custom ops, so a captured per-rank graph keeps each one as a single node.

Graphs name their process group by role ("world": every rank of the engine; "dcp": this rank's
DCP group), never by torch's group id, so a serialized graph runs in any process that registered
its groups with `register_groups`. All traffic goes through torch.distributed (NCCL on GPUs, gloo
on CPU); the ops are functional (they return new tensors), so torch.fx and CUDA graphs see plain
data flow. `record()` lists the collectives a step issues with their message sizes (the planner's
per-step communication figures are checked against it).
"""
from __future__ import annotations

import contextlib

import torch
from torch.library import custom_op

GROUP_ROLES = ("world", "dcp")
_groups: dict = {}
_recording: list | None = None


def register_groups(**groups) -> None:
    """register_groups(world=pg, dcp=pg): the process groups the ops resolve their role names to."""
    for role, pg in groups.items():
        if role not in GROUP_ROLES:
            raise ValueError(f"unknown group role {role!r} (known: {', '.join(GROUP_ROLES)})")
        _groups[role] = pg


def clear_groups() -> None:
    _groups.clear()


def group(role: str):
    if role not in _groups:
        raise RuntimeError(f"no process group registered for role {role!r}: call "
                           f"k3compile.model_def.parallel.comm.register_groups first")
    return _groups[role]


@contextlib.contextmanager
def record():
    """Collect (op, role, message bytes) for every collective issued inside the block."""
    global _recording
    prev, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = prev


def _note(op: str, role: str, t: torch.Tensor) -> None:
    if _recording is not None:
        _recording.append((op, role, t.numel() * t.element_size()))


@custom_op("k3::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, role: str) -> torch.Tensor:
    """Sum of x over the ranks of group `role` (the reduction runs in x's dtype)."""
    import torch.distributed as dist
    out = x.contiguous().clone()
    _note("all_reduce", role, out)
    dist.all_reduce(out, group=group(role))
    return out


@all_reduce.register_fake
def _(x, role):
    return torch.empty_like(x)


def all_reduce_in_place(x: torch.Tensor, role: str) -> None:
    """Sum x over the ranks of group `role` in x's own memory: no staging copy. For fused collective ops
    (passes/kernels) that own their input buffer; graphs use k3::all_reduce, which leaves its input alone."""
    import torch.distributed as dist
    if not x.is_contiguous():
        raise ValueError(f"all_reduce_in_place needs a contiguous tensor, got strides {x.stride()}")
    _note("all_reduce", role, x)
    dist.all_reduce(x, group=group(role))


@custom_op("k3::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, role: str, group_size: int, dim: int) -> torch.Tensor:
    """The ranks' x concatenated along `dim`, in group-rank order."""
    import torch.distributed as dist
    x = x.contiguous()
    _note("all_gather", role, x)
    out = torch.empty((group_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in newer torch
    gather(out, x, group=group(role))  # rank-major along dim 0
    return torch.cat(out.chunk(group_size, 0), dim)


@all_gather.register_fake
def _(x, role, group_size, dim):
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


@custom_op("k3::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, role: str) -> torch.Tensor:
    """x [G, ...]: chunk g goes to group rank g; returns [G, ...] where chunk g came from group rank g."""
    import torch.distributed as dist
    x = x.contiguous()
    _note("all_to_all", role, x)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group(role))
    return out


@all_to_all.register_fake
def _(x, role):
    return torch.empty_like(x)
