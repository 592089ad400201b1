"""P6's latent MoE and the AttnRes norm after it -> one `k3::fused_moe_decode_norm` node: the norm runs as the tail of
the MoE's kernel C (kernels/moe_out_norm.py), one launch per MoE layer less.

Matched (after P6 and P7, in decode and verify graphs), anchored on P6's node:

    y    = k3.fused_moe_decode(x, ids, weights, ..., latent_up_w, ...)       a latent MoE (K3); y read by nothing else
    h, p = k3.attn_res_norm(bank, r, y, query, norm_weight, res_eps, norm_eps, pdl)    y the residual add's delta
         | k3.attn_res_norm(bank, y, None, query, norm_weight, res_eps, norm_eps, pdl) y the row itself (no add)

and replaced by `h, p = k3.fused_moe_decode_norm(bank, r | None, query, norm_weight, res_eps, norm_eps, pdl,
num_warps, block_n, <the MoE node's arguments as they are>)`; users of h and p keep reading them, y is never a graph value.
Kimi-Linear's full-width MoE (no kernel C), a norm with an fp32 copy (P7's `_f32`: a router's input), a norm fed
through a collective (P9's) and anything else off the form above are left alone. Prefill graphs have no P6 node.

Counts: one per MoE layer of a latent-MoE decode graph (each MoE output feeds the next layer's input norm, the last
one the final norm); 0 in Kimi-Linear graphs and in prefill. Numerics: on CPU, and on CUDA where the fused kernel does
not apply, the same two ops (bit-identical); where it runs, the same arithmetic as the pair's kernels (P6's kernel C,
then P7's one-pass norm).

**Off by default** (`enabled`) until the k3-mini-6b ladder measures it (`tools/gpu_mini14.sh`): the norm's tile in
kernel C's registers (ptxas, k3-mini batch 1: 211 registers a thread instead of 96, 2 programs an SM instead of 5) may
cost kernel C more than the launch saves. With the tail, `block_n` sets kernel C's output columns per program (8:
256 programs at batch 1, one wave at 2 an SM) and `num_warps` its warps (0: kernel C's own launch for either).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import fake_mode_of, getitem_outputs, is_call, set_meta_val
from .kernels import moe_out_norm as _kernel  # noqa: F401  (registers torch.ops.k3.fused_moe_decode_norm)
from .p06_fused_moe_decode import TOKEN_STEP_MODES
from .registry import PassConfig, PassConfigError, register_pass

MOE = torch.ops.k3.fused_moe_decode.default
NORM = torch.ops.k3.attn_res_norm.default
FUSED = torch.ops.k3.fused_moe_decode_norm.default
LATENT_UP_W = 14  # fused_moe_decode's latent_up_w argument


@dataclass
class MoeOutNormConfig(PassConfig):
    # off until measured on the device (tools/gpu_mini14.sh: k3-mini-6b ladder, batch 1)
    enabled: bool = False
    # kernel C's warps when it carries the norm's tail (0: the latent launch's own, moe_launch.latent_config); the
    # tail's [bank rows, D] fp32 tile is spread over them (k3-mini: 8 x 2048, 128 a thread at 4 warps)
    num_warps: int = 0
    # kernel C's output columns per program with the tail (0: the latent launch's own, 4 at k3-mini batch 1: 512
    # programs, two waves at the tail's 2 programs an SM; 8: 256 programs, one wave)
    block_n: int = 0

    def validate(self) -> None:
        if self.num_warps not in (0, 1, 2, 4, 8, 16):
            raise PassConfigError(f"p07_moe_out_norm.num_warps must be 0 (kernel C's own) or a power of two up to "
                                  f"16, got {self.num_warps}")
        if self.block_n not in (0, 1, 2, 4, 8, 16, 32, 64):
            raise PassConfigError(f"p07_moe_out_norm.block_n must be 0 (kernel C's own) or a power of two up to 64, "
                                  f"got {self.block_n}")


def _match(moe: Node):
    """(norm node, residual or None, norm outputs) when the latent MoE `moe` feeds one attn_res_norm as the docstring
    says, else None."""
    if moe.kwargs or len(moe.args) <= LATENT_UP_W or moe.args[LATENT_UP_W] is None or len(moe.users) != 1:
        return None
    norm = next(iter(moe.users))
    if not is_call(norm, NORM) or norm.kwargs or len(norm.args) != 8:
        return None
    bank, x, delta, query = norm.args[:4]
    if moe in bank or query is moe or moe in norm.args[4:]:
        return None
    if delta is moe and x is not moe:
        residual = x
    elif x is moe and delta is None:
        residual = None
    else:
        return None
    outs = getitem_outputs(norm)
    if not outs:
        return None
    return norm, residual, outs


@register_pass("p07_moe_out_norm", MoeOutNormConfig)
def moe_out_norm(gm: GraphModule, config: MoeOutNormConfig) -> int:
    """k3.fused_moe_decode (latent) + the k3.attn_res_norm reading its output -> one k3.fused_moe_decode_norm."""
    config.validate()
    if gm.meta.get("k3", {}).get("mode") not in TOKEN_STEP_MODES:
        return 0
    g = gm.graph
    matches, fake_mode = 0, None
    for moe in [n for n in g.nodes if is_call(n, MOE)]:
        m = _match(moe)
        if m is None:
            continue
        norm, residual, outs = m
        fake_mode = fake_mode or fake_mode_of(gm)
        bank, _, _, query, norm_w, res_eps, norm_eps, pdl = norm.args
        # at the norm's place: every MoE argument exists before the MoE node, every norm argument before the norm
        with g.inserting_before(norm):
            fused = g.call_function(FUSED, (bank, residual, query, norm_w, res_eps, norm_eps, pdl,
                                             int(config.num_warps), int(config.block_n), *moe.args))
            items = [g.call_function(operator.getitem, (fused, i)) for i in range(2)]
        for n in [fused, *items]:
            set_meta_val(n, fake_mode)
        for i, node in outs.items():
            node.replace_all_uses_with(items[i])
        for node in [*outs.values(), norm, moe]:
            g.erase_node(node)
        for item in items:  # an output nobody reads: its getitem goes
            if not item.users:
                g.erase_node(item)
        matches += 1
    return matches
