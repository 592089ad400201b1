"""Arrival counters for kernels whose last program to finish a group does the group's fixup.

A kernel that splits one output over several programs (KDA decode's V parts, the MoE "split"
down-projection's expert slots) stores each program's partial result, then bumps an int32 counter
(acq_rel atomic); the program that sees count == parts - 1 is the last, reads every partial, writes
the output and sets the counter back to 0. So the counters are zero between launches and a CUDA graph
replays the kernel with no memset node.

One buffer per (owner, device): kernels of different owners never share counters, so two of them in
flight at once (PDL overlap, a second stream) cannot see each other's counts.
"""
from __future__ import annotations

import torch

_buffers: dict = {}  # (owner, device) -> int32 counters, zero between launches
_outgrown: list = []  # smaller buffers that captured graphs may still use: never freed


def _key(owner: str, device) -> tuple:
    """(owner, device) with a CUDA device's index spelled out: "cuda" and "cuda:0" name one buffer (session 14: a
    test asking for torch.device("cuda") got None for counters a tensor's device, cuda:0, had made)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return owner, d


def arrival_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """At least n zeroed int32 counters for `owner`'s kernels on `device` (shared by its launches: each
    launch leaves them zero)."""
    key = _key(owner, device)
    buf = _buffers.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if key[1].type == "cuda" and torch.cuda.is_current_stream_capturing():
        # zeroed by a memset node of this graph only, so no other graph may share it (the executor's eager
        # warm-up, before any capture, normally allocates the shared one)
        return torch.zeros(n, dtype=torch.int32, device=device)
    if buf is not None:
        _outgrown.append(buf)
    buf = _buffers[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def current(device: torch.device, owner: str) -> torch.Tensor | None:
    """`owner`'s shared counter buffer on `device`, None before its first split launch (tests check that
    every launch left it zero)."""
    return _buffers.get(_key(owner, device))
