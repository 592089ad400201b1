"""Check that a pass kept the step's meaning: run the graph before and after on the same inputs.

Both graphs get their own copy of the same inputs (same values, same strides, so pool views keep
their slot-major layout), the float inputs — the KDA state, conv-window and KV pools — filled with
seeded random values so every pool read matters. Compared after the step: every output (logits)
and every input tensor (the pools the step writes; the batch metadata must stay untouched).

Error measure per tensor: max |after - before| / max |before| (normwise relative, so an element
near zero does not blow it up); NaN/inf patterns must agree exactly; integer tensors must be equal.

Tolerances, by the graph's precision (the narrowest float dtype among its weights):
- fp32: 1e-5. The rewrites only reorder fp32 sums at most (a merged GEMM may block its reduction
  differently); measured differences on k3-tiny are ~3e-7.
- bf16 / fp16: 1e-2, about 2.5 bf16 ulps at the tensor's scale: room for a reordered reduction to
  round one output a ulp differently and for that to spread through a few layers, while a real
  bug (a wrong column block, a dropped bias, a swapped expert) moves logits by O(1). Measured on
  CPU: P1-P4 are bit-identical in bf16 (0.0). Known limit: if a one-ulp difference flips an
  expert choice (possible when verifying on a GPU whose GEMM algorithm differs between the merged
  and the split shapes), the logits move by more than this and verification reports it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule

TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-9, torch.bfloat16: 1e-2, torch.float16: 1e-2}


class PassVerificationError(RuntimeError):
    """A pass changed the step's results beyond tolerance (or broke the graph)."""


@dataclass
class Comparison:
    max_rel_err: float  # worst over all compared tensors
    worst: str  # which tensor
    tolerance: float


def step_inputs(model, mode: str, seed: int = 0, page_size: int = 4) -> list:
    """Inputs for verifying a captured step of `model`: capture's example batch (sizes the graph
    was not specialized on) with random token ids; pools are randomized by `randomized_inputs`."""
    from k3compile.capture import example_batch, step_args
    from k3compile.model_def.cache import CacheTensors
    from k3compile.model_def.draft_window import VERIFY_MODES, WINDOW_MODES, DraftWindow, DraftWindowSpec

    device = model.lm_head.weight.device
    cache = CacheTensors.allocate(model.cache_spec(), 4, 16, page_size, device)
    batch = example_batch(mode, cache, device)
    gen = torch.Generator().manual_seed(seed)
    batch.input_ids = torch.randint(0, model.config.vocab_size, batch.input_ids.shape, generator=gen).to(device)
    args = list(step_args(batch, cache))
    if mode in VERIFY_MODES:  # the draft window the verify step writes (as capture_step allocates it)
        args += DraftWindow.allocate(DraftWindowSpec(model.cache_spec(), 6, WINDOW_MODES[mode]), 5, device).tensors()
    return args


def graph_precision(gm: GraphModule) -> torch.dtype:
    """The narrowest float dtype among the graph's constants (fp32 when it has none)."""
    found = {getattr(gm, n.target).dtype for n in gm.graph.nodes
             if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        if dtype in found:
            return dtype
    return torch.float32


def randomized_inputs(inputs, seed: int = 0) -> list:
    """Copies of `inputs` with every float tensor filled with N(0, 1) values (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            r = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.dtype)
            x = _same_strides(x)
            x.copy_(r.to(x.device))
        out.append(x)
    return out


def _same_strides(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _copy_inputs(inputs) -> list:
    return [_same_strides(x).copy_(x) if isinstance(x, torch.Tensor) else x for x in inputs]


def run_graph(gm: GraphModule, inputs) -> tuple[list, list]:
    """Run on a private copy of `inputs`; returns (outputs as a list, inputs after the step)."""
    args = _copy_inputs(inputs)
    with torch.no_grad():
        out = gm(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return outs, args


def rel_err(after: torch.Tensor, before: torch.Tensor) -> float:
    if after.shape != before.shape or after.dtype != before.dtype:
        return float("inf")
    if not before.is_floating_point():
        return 0.0 if torch.equal(after, before) else float("inf")
    a, b = after.double(), before.double()
    fin_a, fin = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fin_a, fin):
        return float("inf")
    odd_a, odd_b = a[~fin], b[~fin]  # NaN and inf must be where they were, and the same
    if not torch.equal(odd_a.isnan(), odd_b.isnan()) or not torch.equal(odd_a.nan_to_num(0.0), odd_b.nan_to_num(0.0)):
        return float("inf")
    if not fin.any():
        return 0.0
    diff = (a[fin] - b[fin]).abs().max().item()
    scale = b[fin].abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def run_checked(gm: GraphModule, inputs) -> tuple[list, list]:
    """run_graph, with a failure to run reported as a verification error."""
    try:
        return run_graph(gm, inputs)
    except Exception as e:
        raise PassVerificationError(f"the graph no longer runs: {type(e).__name__}: {e}") from e


def compare_results(new: tuple[list, list], ref: tuple[list, list], input_names, tolerance: float) -> Comparison:
    """Compare two `run_graph` results (outputs, inputs after); raise PassVerificationError beyond tolerance."""
    (new_out, new_in), (ref_out, ref_in) = new, ref
    if len(new_out) != len(ref_out):
        raise PassVerificationError(f"the graph returns {len(new_out)} outputs instead of {len(ref_out)}")
    names = list(input_names) if input_names else [f"input {i}" for i in range(len(ref_in))]
    pairs = [(f"output {i}" if len(ref_out) > 1 else "logits", a, b) for i, (a, b) in enumerate(zip(new_out, ref_out))]
    pairs += [(names[i], a, b) for i, (a, b) in enumerate(zip(new_in, ref_in)) if isinstance(b, torch.Tensor)]
    worst, worst_err, failures = "", 0.0, []
    for name, a, b in pairs:
        err = rel_err(a, b)
        if err > worst_err or not worst:
            worst, worst_err = name, err
        if err > tolerance:
            detail = "shape/dtype/non-finite mismatch" if err == float("inf") else f"max rel err {err:.3g}"
            failures.append(f"{name} ({detail})")
    if failures:
        raise PassVerificationError(f"results differ beyond tolerance {tolerance:g}: {', '.join(failures)}")
    return Comparison(worst_err, worst, tolerance)


def compare_graphs(before: GraphModule, after: GraphModule, inputs, input_names=None,
                   tolerance: float | None = None) -> Comparison:
    """Run both graphs on copies of `inputs` and compare (tolerance by `before`'s precision by default)."""
    tol = tolerance if tolerance is not None else TOLERANCES.get(graph_precision(before), 1e-5)
    return compare_results(run_checked(after, inputs), run_graph(before, inputs), input_names, tol)
