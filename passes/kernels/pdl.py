"""Programmatic dependent launch (PDL): whether the step's Triton kernels may use it here.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still
running (sm90+), so every such kernel of ours loads only weights before `tl.extra.cuda.gdc_wait()`
(which returns once the predecessor has finished and its writes are visible), and calls
`gdc_launch_dependents()` once it has read its inputs so the next kernel's launch overlaps its tail.
The public measurements say the attribute without those device-side calls gains nothing.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def pdl_available(device_index: int | None = None) -> bool:
    """Triton can launch with PDL and has the device-side calls (Triton >= 3.4), on an sm90+ GPU; never
    under TRITON_INTERPRET=1 (the interpreter has no grid dependencies)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_for(requested: bool, tensor: torch.Tensor) -> bool:
    """Whether a launch on `tensor`'s device uses PDL: asked for, a CUDA tensor, and `pdl_available` there.
    (tools/aot_check.py replaces it to compile the PDL variants of the kernels without a GPU.)"""
    return bool(requested) and tensor.is_cuda and pdl_available(tensor.device.index)
