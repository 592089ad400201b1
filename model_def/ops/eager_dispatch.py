"""`k3.NAME(*args)`: the model's calls of its `k3::` ops, straight to the op's code in plain eager mode.

A `torch.library.custom_op` call costs about 0.1 ms of Python on CPU before the op's own code runs (the
autograd wrapper, the ADInplaceOrView version bumps, the output aliasing check): ~20% of a k3-tiny eager
decode step. When nothing can observe the difference -- no tracing (make_fx, torch.export, Dynamo,
torch.jit), no dispatch or function mode, no profiler, no autograd graph to record, ordinary tensors on one
CPU or CUDA device -- `k3.NAME` runs the implementation the dispatcher would pick for that device (a
`register_kernel` override, else the op's reference). Otherwise it calls `torch.ops.k3.NAME`, so captured
graphs, exported programs and profiler traces keep each op as the single node they had before.
"""
from __future__ import annotations

import torch
from torch._library.custom_ops import OPDEFS

_PARAMETER = torch.nn.Parameter
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}  # the devices a call may go direct on


def direct_device(args) -> str | None:
    """The device type every tensor in `args` is on if a call with them may skip the dispatcher, else None.
    (About 3 us: it runs on every op call.)"""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._autograd._profiler_enabled()
            or torch._C._get_tracing_state() is not None
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return None
    grad = torch.is_grad_enabled()
    device = None
    for a in args:
        if isinstance(a, torch.Tensor):
            kind = type(a)
            if kind is not torch.Tensor and kind is not _PARAMETER:  # a subclass (FakeTensor, ...): its own rules
                return None
            if grad and a.requires_grad:  # autograd records the op (moe_experts has a backward)
                return None
            kind = "cuda" if a.is_cuda else "cpu" if a.is_cpu else None
            if kind is None or (device is not None and kind != device):
                return None
            device = kind
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return None  # tensor lists: none of the k3 ops take one; leave them to the dispatcher
    return device


def _caller(name: str):
    packet = getattr(torch.ops.k3, name)  # AttributeError for an op that was never registered, as torch.ops
    opdef = OPDEFS.get(f"k3::{name}")
    # custom_op's private fields (torch >= 2.4); without them (a raw torch.library op, another torch) every
    # call takes the dispatcher: slower, never different
    if opdef is None or not all(hasattr(opdef, f) for f in ("_init_fn", "_backend_fns")):
        return packet
    # per device: may the call go direct? Not if the dispatcher holds a kernel for the device that custom_op's
    # register_kernel did not put there (a raw torch.library impl; asked once: the lookup takes ~30 us)
    direct_ok: dict[str, bool] = {}

    def call(*args):
        device = direct_device(args)
        if device is not None:
            ok = direct_ok.get(device)
            if ok is None:
                ok = direct_ok[device] = device in opdef._backend_fns or not \
                    torch._C._dispatch_has_kernel_for_dispatch_key(packet._qualified_op_name, _DISPATCH_KEYS[device])
            if ok:
                # the dispatcher's choice for this device: its override (which honours a disabled kernel), else
                # the reference (custom_op registers it for every device)
                return opdef._backend_fns.get(device, opdef._init_fn)(*args)
        return packet(*args)

    call.__name__ = call.__qualname__ = name
    return call


class _K3Ops:
    """Namespace of the `k3::` ops, as torch.ops.k3 (positional arguments, as the model calls them)."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if torch.compiler.is_compiling():  # a first lookup under Dynamo: it traces the op itself
            return getattr(torch.ops.k3, name)
        call = _caller(name)
        setattr(self, name, call)  # later lookups find the attribute and skip __getattr__
        return call


k3 = _K3Ops()
