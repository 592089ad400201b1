"""Captured steps shared by the test files that build engines or run benches in one process (tests/conftest.py's
SHARED_CAPTURES): `k3compile.capture.capture_step` of a model equal to one captured before (same class, module
attributes, weights' bytes and ties, mode, page size) returns a copy of that capture instead of tracing again
(~5-8 CPU s per k3-tiny graph; the engine and bench files captured k3-tiny's decode step eight times).

The copy is what a fresh capture gives: the same graph, node metadata and gm.meta, and its weight attributes bound
to THIS model's tensors (benches write router biases in place and expect the graph to read them). A model whose
key cannot be computed (an attribute whose repr is an object address) is captured as usual."""
from __future__ import annotations

import hashlib

import torch

from k3compile import capture as capture_module
from k3compile.passes.manager import snapshot


def model_key(model: torch.nn.Module, mode: str, page_size: int) -> tuple | None:
    """What capture_step's graph depends on, or None where a module attribute has no stable repr."""
    modules = []
    for name, mod in model.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(mod).items() if not k.startswith("_")))
        hooks = tuple(len(getattr(mod, h)) for h in ("_forward_hooks", "_forward_pre_hooks"))
        modules.append((name, type(mod).__module__, type(mod).__qualname__, attrs, hooks))
    if any(" at 0x" in value for *_, attrs, _ in modules for _, value in attrs):
        return None
    digest, first_of_storage = hashlib.blake2b(digest_size=16), {}
    tensors = [("p", n, t) for n, t in model.named_parameters()] + [("b", n, t) for n, t in model.named_buffers()]
    for kind, name, t in tensors:
        tied = first_of_storage.setdefault((t.device, t.untyped_storage().data_ptr()), name)  # ties: shared storage
        digest.update(repr((kind, name, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), tied)).encode())
        digest.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return (mode, page_size, tuple(modules), digest.hexdigest())


def bind_weights(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Point the graph's weight attributes at `model`'s tensors, as capture_step's renaming names them."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        attr = capture_module._param_attr_name(name)
        for table in (gm._parameters, gm._buffers):  # a copy holds parameters as parameters (fx's _copy_attr)
            if attr in table:
                table[attr] = t


class MemoCapture:
    """A stand-in for capture_step that shares captures while `enabled` (the conftest turns it on per test file)."""

    def __init__(self, real):
        self.real, self.enabled, self.hits, self.misses = real, False, 0, 0
        self.captures: dict[tuple, torch.fx.GraphModule] = {}  # key -> the first capture (only copies handed out)

    def __call__(self, model: torch.nn.Module, mode: str, page_size: int = 4) -> torch.fx.GraphModule:
        key = model_key(model, mode, page_size) if self.enabled else None
        if key is None:
            return self.real(model, mode, page_size)
        if key in self.captures:
            self.hits += 1
        else:
            self.misses += 1
            self.captures[key] = self.real(model, mode, page_size)
        gm = snapshot(self.captures[key])
        bind_weights(gm, model)
        return gm


def install() -> MemoCapture:
    """Replace capture_step where the package looks it up (the capture module; engine/build's import of it)."""
    from k3compile.engine import build

    memo = MemoCapture(capture_module.capture_step)
    capture_module.capture_step = build.capture_step = memo
    return memo
