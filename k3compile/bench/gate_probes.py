"""Calibration probes for the accuracy gate: eager model_def with a known rounding-only change and with a
deliberate bug, so every gate run shows, at its own shape and dtype, what rounding gives and what a bug gives.

- `reordered_gemms()`: every dense GEMM (aten mm / addmm) of the step computed as the sum of its two
  K-halves, each half's product rounded to the compute dtype before the add: a split-K reduction, as P8's
  GEMV does, with one more rounding per output than a fused fp32 accumulate. A rounding-only change (the
  same sum reordered) at every projection of every layer: more rounding points than any one pass changes.
  Custom ops (the k3:: expert, attention and KDA ops) run unchanged (a dispatch mode is off inside them).
- `injected_bug(model, kind)`: one MoE layer (the middle one) made wrong, the size of bug a fused kernel makes:
  "scale": its output x 1.01 (a wrong constant in an epilogue);
  "drop_shared": its shared expert's output left out (an epilogue that forgot a term);
  "wrong_expert": every token's expert ids shifted by one (mod E) with the weights kept (an indexing bug:
  the kind that free routing cannot tell from a rounding-flipped choice).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
BUGS = ("scale", "drop_shared", "wrong_expert")
SCALE_BUG = 1.01


class _SplitK(TorchDispatchMode):
    def __init__(self, split: float):
        super().__init__()
        self.split = split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs:
            return func(*args, **kwargs)
        if func is aten.mm.default:
            return self._mm(*args)
        if func is aten.addmm.default:
            bias, a, b = args
            return self._mm(a, b) + bias
        return func(*args)

    def _mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = min(max(1, int(a.shape[-1] * self.split)), a.shape[-1] - 1)
        if a.shape[-1] < 2:
            return torch.mm(a, b)
        return torch.mm(a[:, :h], b[:h]) + torch.mm(a[:, h:], b[h:])


@contextmanager
def reordered_gemms(split: float = 0.5):
    """Eager steps run inside it compute every mm/addmm as mm(first `split` of K) + mm(the rest), each
    product rounded to the compute dtype before the add: a rounding-only change."""
    if not 0.0 < split < 1.0:
        raise ValueError(f"reordered_gemms: split must be in (0, 1), got {split}")
    with _SplitK(split):
        yield


def _moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from k3compile.model_def.layers.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


@contextmanager
def injected_bug(model: torch.nn.Module, kind: str):
    """Eager steps run inside it have one wrong MoE layer (the middle one); see the module docstring."""
    if kind not in BUGS:
        raise ValueError(f"unknown injected bug {kind!r}; known: {', '.join(BUGS)}")
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("injected bug: the model has no MoE layer")
    layer = layers[len(layers) // 2]
    if kind == "drop_shared":
        if not hasattr(layer, "shared_experts"):
            raise ValueError("injected bug drop_shared: the model's MoE layers have no shared expert")
        handle = layer.shared_experts.register_forward_hook(lambda mod, inp, out: out * 0)
    elif kind == "wrong_expert":
        experts = layer.gate.e_score_correction_bias.shape[0]
        handle = layer.gate.register_forward_hook(lambda mod, inp, out: (out[0], (out[1] + 1) % experts))
    else:
        handle = layer.register_forward_hook(lambda mod, inp, out: out * SCALE_BUG)
    try:
        yield
    finally:
        handle.remove()


def probe_runners(model: torch.nn.Module, eager, bugs=BUGS) -> dict:
    """{probe name: runner} around the eager runner `eager(batch) -> logits`: the rounding-only change, then each bug."""
    def wrap(ctx_factory):
        def run(batch):
            with ctx_factory():
                return eager(batch)
        return run

    runners = {"probe:reordered-gemms": wrap(reordered_gemms)}
    for kind in bugs if _moe_layers(model) else ():
        if kind == "drop_shared" and not all(hasattr(m, "shared_experts") for m in _moe_layers(model)):
            continue
        runners[f"probe:bug-{kind}"] = wrap(lambda kind=kind: injected_bug(model, kind))
    return runners
