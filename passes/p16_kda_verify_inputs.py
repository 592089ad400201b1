"""P16 ReplaySSM window inputs with P5's arithmetic: after each KDA layer's `k3.kda_verify` in a verify
graph, one `k3.kda_verify_inputs` rewrites that layer's window rows (k, v, g, beta).

Why: the fold (runtime/spec/fold_kernel.py) replays the accepted prefix from the window with P5's
recurrence, so the state after speculation is bit-identical to P5's decode only if the window holds
the values P5 computes in its registers; the reference ops of the verify graph (torch's conv, sigmoid,
exp) differ from Triton's in the last bits. The new op runs P5's conv/gate/beta code on CUDA
(passes/kernels/kda_verify_inputs.py) and the reference arithmetic on CPU, so CPU graphs compute the
same window, bit for bit, with or without the pass.

Matched (the ATen form of `KDAMixer.forward` in verify mode), anchored on `k3.kda_verify`:

    k, v  = view(k3.short_conv_verify(x_s, w_s, conv, layer, s * C, slots, win_x), [N, H, K])   s = 1, 2
    g     = the decay gate P5 matches (K3's lower-bound sigmoid or Kimi Linear's softplus form)
            of xf = view(add(f, dt_bias), [N, H, K]), or view(addmm(dt_bias, f_a, t(W_fb)), [N, H, K])
            where P11 folded the bias add into f_b_proj's GEMM (fp32 graphs): f := that addmm, dt_bias := None
    beta  = sigmoid(b)
    o     = k3.kda_verify(q, k, v, g, beta, ssm, layer, slots, win_k, win_v, win_g, win_beta)

(operands may sit behind an fp32 cast, which is skipped: the op upcasts itself) and gains, right after
`kda_verify` (so its writes land last),

    k3.kda_verify_inputs(x_k, x_v, w_k, w_v, f, dt_bias | None, A_log, b, conv, layer, slots,
                         win_k, win_v, win_g, win_beta, lower_bound | None, launch)

Nothing is erased: kda_verify still computes the outputs o (they only feed logits) and
short_conv_verify still stores the conv inputs (win_x) for the conv rollback. f is the up-projected
forget input as the graph computes it (f_b_proj's mm stays in the graph: the verify-inputs kernel has
no low-rank absorb). Only "verify" graphs have `kda_verify` ("verify_snapshot" graphs call
`kda_verify_snapshot`, decode `kda_decode`, prefill `kda_prefill`), so no other graph is touched.

Numbered P16, after the DESIGN.md table's P1-P15: a pass module must be named `pNN_*` to be
discovered, and sorting after every other pass lets it match the verify graph those passes leave (it
reads only kda_verify's operand chains, which no earlier pass rewrites in verify graphs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, LAYOUTS

from .graph_utils import fake_mode_of, is_call, known_equal, set_meta_val, val_of
from .kernels import kda_verify_inputs  # noqa: F401  (registers torch.ops.k3.kda_verify_inputs)
from .p05_fused_kda_decode import _match_forget, _match_gate, _Pattern, _tensor
from .patterns import NoMatch, need
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
_SHORT_CONV = torch.ops.k3.short_conv_verify.default
_KDA_VERIFY = torch.ops.k3.kda_verify.default
_VERIFY_INPUTS = torch.ops.k3.kda_verify_inputs.default


@dataclass
class KDAVerifyInputsConfig(PassConfig):
    # (the op's decode batch is the verify step's rows: see kernels/kda_verify_inputs.py)
    # P5's launch layout, whose blocks the window inputs (and the fold) reproduce: must name the layout
    # p05_fused_kda_decode.launch names (PipelineConfig.validate checks)
    launch: str = DEFAULT_LAYOUT

    def validate(self) -> None:
        if self.launch not in LAYOUTS:
            raise PassConfigError(f"p16_kda_verify_inputs: launch must be one of {', '.join(LAYOUTS)}, "
                                  f"got {self.launch!r}")


def _match_conv(p: _Pattern, arg, stream: int, kda: Node, heads: int, head_dim: int):
    """k or v argument -> (pre-conv input, conv weight, conv pool)."""
    view = p.take(arg, aten.view.default)
    need(list(view.args[1])[1:] == [heads, head_dim])
    conv = p.take(view.args[0], _SHORT_CONV)
    x, w, pool, layer, offset, slots, _ = conv.args
    need(offset == stream * heads * head_dim and layer == kda.args[6] and slots is kda.args[7])
    return x, w, pool


def _match_forget_or_addmm(p: _Pattern, node: Node, tokens, heads: int, head_dim: int) -> tuple:
    """xf = view(add(f, dt_bias), [N, H, K]) -> (f, None, dt_bias), as P5 reads it; or, after P11 folded
    the bias add into f_b_proj's GEMM, view(addmm(dt_bias, f_a, t(W)), [N, H, K]) -> (addmm, None, None):
    f then already holds f + dt_bias (None tells the op there is nothing to add)."""
    try:
        return _match_forget(p, node, tokens, heads, head_dim)
    except NoMatch:
        pass
    view = p.take(node, aten.view.default)
    need(len(view.args[1]) == 3 and list(view.args[1])[1:] == [heads, head_dim])
    addmm = p.take(view.args[0], aten.addmm.default)
    need(not addmm.kwargs and len(addmm.args) == 3)
    fv = _tensor(addmm, 2)
    need(known_equal(fv.shape[0], tokens) and fv.shape[1] == heads * head_dim)
    return addmm, None, None


def _match(kda: Node) -> tuple:
    p = _Pattern(absorb_low_rank=False)
    _, k, v, g, beta, _, layer, slots, win_k, win_v, win_g, win_beta = kda.args
    kv = val_of(k)
    need(kv is not None and kv.dim() == 3 and isinstance(kv.shape[1], int) and isinstance(kv.shape[2], int))
    tokens, heads, head_dim = kv.shape
    need(tuple(val_of(v).shape[1:]) == (heads, head_dim))  # the kernel takes K == V
    x_k, w_k, conv_k = _match_conv(p, k, 1, kda, heads, head_dim)
    x_v, w_v, conv_v = _match_conv(p, v, 2, kda, heads, head_dim)
    need(conv_k is conv_v)
    f, _, dt, a_log, lower_bound = _match_gate(p, g, tokens, heads, head_dim, _match_forget_or_addmm)
    b = p.upcast(p.take(beta, aten.sigmoid.default).args[0])
    need(tuple(_tensor(b, 2).shape[1:]) == (heads,))
    return (x_k, x_v, w_k, w_v, f, dt, a_log, b, conv_k, layer, slots, win_k, win_v, win_g, win_beta, lower_bound)


@register_pass("p16_kda_verify_inputs", KDAVerifyInputsConfig)
def kda_verify_inputs(gm: GraphModule, config: KDAVerifyInputsConfig) -> int:
    """ReplaySSM window inputs (k, v, g, beta) of each KDA layer in verify graphs -> k3.kda_verify_inputs (P5's arithmetic)."""
    matches, fake_mode = 0, None
    for kda in [n for n in gm.graph.nodes if is_call(n, _KDA_VERIFY)]:
        try:
            args = (*_match(kda), config.launch)
        except NoMatch:
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        # right after kda_verify: every input is an ancestor of it, and the window rows it wrote are overwritten
        with gm.graph.inserting_after(kda):
            node = gm.graph.call_function(_VERIFY_INPUTS, args)
        set_meta_val(node, fake_mode)
        matches += 1
    return matches
