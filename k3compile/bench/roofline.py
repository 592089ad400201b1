"""Bytes a decode step must move: the numerator of the HBM-roofline figure (docs/BENCHMARKS.md rule 3).

    bytes/step = W_dense + W_experts(routed) + W_embed(rows) + KV_read + KV_write + state_rw
    W_dense    = every non-expert weight and buffer, whole (projections, norms, routers, lm_head)
    W_experts  = per MoE layer, (#distinct experts the step routed to) x (w13 + w2 of one expert)
    W_embed    = (#distinct input tokens) x hidden x itemsize (a lookup reads rows, not the table)
    KV_read    = B x context x (MLA latent row bytes, all MLA layers); KV_write = B x one row each
    state_rw   = 2 x B x (KDA recurrent state + short-conv window), read and written once
    % of HBM roofline = (bytes/step / copy bandwidth) / measured step time

The routed experts come from running the step once with hooks on the routers; the timed steps
see the same batch, so their routing is the same up to the state drift of repeated steps.
"""
from __future__ import annotations

import re

import torch

from k3compile.model_def.cache import CacheSpec

FORMULA = ("roofline % = (bytes/step / copy bandwidth) / step time; bytes/step = non-expert weights + "
           "routed experts' weights (distinct experts per MoE layer) + embedding rows + KV read (B x context "
           "rows) + KV write (B rows) + 2 x KDA state and conv window per request")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@torch.no_grad()
def routed_experts(model, run_step) -> dict[int, int]:
    """{layer index: distinct experts routed to} observed while run_step() runs the model once."""
    from k3compile.model_def.layers.moe import Router

    seen: dict[int, int] = {}
    handles = []
    for name, mod in model.named_modules():
        m = _LAYER.match(name + ".")
        if isinstance(mod, Router) and m:
            layer = int(m.group(1))

            def hook(_mod, _inp, out, layer=layer):
                seen[layer] = int(torch.unique(out[1]).numel())
            handles.append(mod.register_forward_hook(hook))
    try:
        run_step()
    finally:
        for h in handles:
            h.remove()
    return seen


def step_bytes(model, spec: CacheSpec, batch_size: int, context: int, distinct_tokens: int,
               experts_routed: dict[int, int]) -> dict:
    dense = experts = embed = 0
    tied = model.config.tie_word_embeddings
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if ".experts." in name:
            layer = int(_LAYER.match(name).group(1))
            experts += experts_routed.get(layer, 0) * nbytes // t.shape[0]
        elif name.endswith("embed_tokens.weight") and not tied:
            embed += distinct_tokens * t.shape[1] * t.element_size()
        else:
            dense += nbytes
    kv_read = batch_size * context * spec.kv_bytes_per_token
    kv_write = batch_size * spec.kv_bytes_per_token
    state = 2 * batch_size * (spec.ssm_bytes_per_slot + spec.conv_bytes_per_slot)
    total = dense + experts + embed + kv_read + kv_write + state
    return {"dense_weights": dense, "routed_expert_weights": experts, "embedding_rows": embed,
            "kv_read": kv_read, "kv_write": kv_write, "state_read_write": state, "total": total,
            "experts_routed_per_layer": {str(k): v for k, v in sorted(experts_routed.items())}}


def roofline_pct(total_bytes: int, bandwidth_bytes_per_s: float, step_ms: float) -> float:
    return 100.0 * (total_bytes / bandwidth_bytes_per_s) / (step_ms / 1e3)
