"""Pinned routing for the accuracy gate: every MoE layer picks a fixed set of experts, whatever its input.

Why: on random weights the router's top-k is a discontinuity. A bf16-rounding-sized change upstream
flips near-tied expert choices, the flip moves that layer's output by O(1) of its size, and 26 MoE
layers later the logits differ by 0.2-0.5 (the H200 ladder flagged P5, P6, P8, P15 that way while
every kernel passed its own test). With the choice pinned, a rounding change can only move the
expert weights (continuous), so rounding stays rounding and a real bug still shows.

How, without touching model_def and without a second copy of the weights: routing is DeepSeek-V3
"noaux_tc" (model_def/ops/moe_math.py `route`, P4's `k3.fused_route`, which P6's fused MoE consumes):

    scores = sigmoid(router logits)                 fp32, in (0, 1)
    choice = scores + e_score_correction_bias       selection only
    ids    = top_k(choice) [within the topk_group best groups when num_expert_group > 1]
    weights = scores[ids] (renormalized, scaled)    the bias never enters the weights

So the correction bias is a selection-only knob. Every `model_def.layers.moe.Router` has it (a zero
fp32 buffer when a checkpoint ships none); K3's latent MoE routes with the same Router on the
full-width x (only the experts run in the latent space), so one mechanism covers Kimi-Linear and K3.
While pinned, each router's bias is overwritten in place with PIN_BASE + PIN_GAP * (k-1-j) for its
j-th pinned expert and 0 elsewhere: a pinned expert's choice lies in [PIN_BASE + PIN_GAP*i,
PIN_BASE + PIN_GAP*i + 1], an unpinned one's in [0, 1], so the set AND its order (the order of
(id, weight) pairs the expert kernels sum over) are fixed for every token. With group limiting, the
pinned experts lie in topk_group groups chosen first; such a group scores >= PIN_BASE > 2 >= any other
group's top-2 sum, so the pinned groups are the kept ones. The sets differ per layer (seeded), so the
gate still exercises varied experts and weight rows, though every token of a batch uses the same k
experts in a layer (a per-expert bias cannot differ per token): the free-routing run covers the
per-token spread.

The rung graphs share these buffers with the model (capture lifts parameters and buffers as get_attr
constants of the same storage; passes/manager.snapshot shares them too; CUDA graphs read them at replay),
so the in-place pin reaches eager and every rung alike. `bias_reads(graph, model)` counts how many of the
model's router biases a graph reads by storage, so the ladder can show the pin reached each rung.
On exit the saved biases (E fp32 values per layer: kilobytes) are copied back bit-exactly, also on error.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

PIN_BASE = 4.0  # > 2 = the largest top-2 group score an unpinned group can reach (scores < 1, bias 0)
PIN_GAP = 2.0  # > 1 = the spread of sigmoid scores: consecutive pinned experts never swap
PIN_SEED = 0


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers (model_def Router modules), in layer order."""
    from k3compile.model_def.layers.moe import Router

    return [m for m in model.modules() if isinstance(m, Router)]


def pinned_experts(num_experts: int, top_k: int, num_expert_group: int, topk_group: int,
                   gen: torch.Generator) -> list[int]:
    """top_k distinct experts, drawn (seeded) from topk_group random groups, in pin order (first = highest)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"pinned routing: top_k {top_k} must be in 1..{num_experts} experts")
    size = num_experts // num_expert_group
    groups = torch.randperm(num_expert_group, generator=gen)[:topk_group]
    pool = torch.cat([torch.arange(g * size, (g + 1) * size) for g in groups.tolist()])
    if top_k > len(pool):
        raise ValueError(f"pinned routing: top_k {top_k} > the {len(pool)} experts of {topk_group} kept groups")
    return pool[torch.randperm(len(pool), generator=gen)[:top_k]].tolist()


def pin_bias(router: torch.nn.Module, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """(the bias that pins `router`, same shape/dtype/device as its own; its pinned experts in order)."""
    bias = router.e_score_correction_bias
    ids = pinned_experts(bias.shape[0], router.top_k, router.groups, router.topk_group, gen)
    pinned = torch.zeros(bias.shape, dtype=torch.float32)
    for j, e in enumerate(ids):
        pinned[e] = PIN_BASE + PIN_GAP * (len(ids) - 1 - j)
    return pinned.to(dtype=bias.dtype, device=bias.device), ids


@contextmanager
def pinned_routing(model: torch.nn.Module, seed: int = PIN_SEED):
    """Pin every router of `model` in place; yields {router index: pinned expert ids}; restores exactly."""
    rs = routers(model)
    saved = [r.e_score_correction_bias.detach().clone() for r in rs]
    gen = torch.Generator().manual_seed(seed)
    pins = {}
    try:
        for i, r in enumerate(rs):
            pinned, pins[i] = pin_bias(r, gen)
            r.e_score_correction_bias.copy_(pinned)
        yield pins
    finally:
        for r, s in zip(rs, saved):
            r.e_score_correction_bias.copy_(s)


def bias_reads(graph: torch.fx.GraphModule, model: torch.nn.Module) -> int:
    """How many of `model`'s router biases `graph` reads through a get_attr of the same storage (a pass that
    copied a bias would hide the pin from that graph: the ladder reports this count per rung)."""
    ptrs = {r.e_score_correction_bias.data_ptr() for r in routers(model)}
    seen = set()
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            t = getattr(graph, node.target, None)
            if isinstance(t, torch.Tensor) and t.data_ptr() in ptrs:
                seen.add(t.data_ptr())
    return len(seen)
