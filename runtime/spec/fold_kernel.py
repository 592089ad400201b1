"""ReplaySSM fold kernel: the accepted prefix of every request's draft window into its KDA state, in
place, for all KDA layers and heads in one launch (issue 13, item 4; spec §5.3).

One program per (request, KDA layer, head). For t < accept_len it replays the decode recurrence from
the stored raw inputs, with the arithmetic of the fused decode kernel (passes/kernels/kda_decode.py,
P5) expression for expression, so on the GPU the folded state is bit-identical to the one P5 writes
for the same inputs:

    k     = k_raw / sqrt(sum(k_raw^2) + 1e-6)          over a [BK] vector (the same layout as P5)
    decay = where(k mask, exp(g), 0)                   g stored after the gate activation
    per [BK, BV=32] column block of the state:  s = s * decay[:, None];
    kv    = sum(s * k[:, None], axis=0);  s += k[:, None] * ((v - kv) * beta)[None, :]

P5 walks the state in [K, BV] column blocks whose width and warps its launch layout picks from the decode
batch's size (model_def/ops/kda_launch.py, the one rule both import), and the block's shape and num_warps
fix the reductions' order: so the fold uses the blocks P5 would use for a decode step of the same batch
under the same layout (the engine's P5 `launch` option). Here a block stays in registers across the accepted positions
(loading and storing fp32 is exact) and is stored once. The conv windows roll back separately
(`draft_window.roll_conv`).

CPU tensors work under TRITON_INTERPRET=1 (set before import); `fold_reference` is the pure-torch
definition (model_def.draft_window.commit_reference), which the tests compare with.
"""
from __future__ import annotations

import os

import torch

from k3compile.model_def.draft_window import DraftWindow, check_commit, commit_reference, roll_conv
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, check_layout, kda_launch
from k3compile.model_def.ops.kda_math import L2_EPS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: commit runs the reference
    triton = None

def fold_reference(cache, window: DraftWindow, slots: list[int], accept_lens: list[int]) -> None:
    commit_reference(cache, window, slots, accept_lens)


if triton is not None:

    @triton.jit
    def _fold_kernel(ssm_ptr, ssm_slot_stride, ssm_layer_stride,
                     k_ptr, v_ptr, g_ptr, beta_ptr,
                     w_row, w_layer, w_pos, wb_row, wb_layer, wb_pos,
                     slots_ptr, accept_ptr,
                     N_LAYERS: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, L2EPS: tl.constexpr):
        pid = tl.program_id(0)
        head = pid % H
        layer = (pid // H) % N_LAYERS
        row = (pid // (H * N_LAYERS)).to(tl.int64)
        n = tl.load(accept_ptr + row)
        if n > 0:
            slot = tl.load(slots_ptr + row).to(tl.int64)
            ok = tl.arange(0, BK)
            mk = ok < K
            s_base = ssm_ptr + slot * ssm_slot_stride + layer * ssm_layer_stride + head * K * V
            # window rows: k, v [R, n_layers, L, H, K|V] (activation dtype); g the same in fp32; beta [R, n_layers, L, H]
            kv_off = row * w_row + layer * w_layer + head * K
            b_off = row * wb_row + layer * wb_layer + head
            for v0 in range(0, V, BV):
                ov = v0 + tl.arange(0, BV)
                mv = ov < V
                s_ptrs = s_base + ok[:, None] * V + ov[None, :]
                m2 = mk[:, None] & mv[None, :]
                s = tl.load(s_ptrs, mask=m2, other=0.0)
                for t in range(0, n):
                    k = tl.load(k_ptr + kv_off + t * w_pos + ok, mask=mk, other=0.0).to(tl.float32)
                    k = k / tl.sqrt(tl.sum(k * k, axis=0) + L2EPS)
                    g = tl.load(g_ptr + kv_off + t * w_pos + ok, mask=mk, other=0.0)
                    decay = tl.where(mk, tl.exp(g), 0.0)
                    beta = tl.load(beta_ptr + b_off + t * wb_pos)
                    v = tl.load(v_ptr + kv_off + t * w_pos + ov, mask=mv, other=0.0).to(tl.float32)
                    s = s * decay[:, None]
                    kv_mem = tl.sum(s * k[:, None], axis=0)
                    s += k[:, None] * ((v - kv_mem) * beta)[None, :]
                tl.store(s_ptrs, s, mask=m2)


def kernel_supports(window: DraftWindow) -> bool:
    c = window.spec.cache
    return (triton is not None and c.kda_head_k == c.kda_head_v
            and triton.next_power_of_2(c.kda_head_k) * triton.next_power_of_2(c.kda_head_v) <= 128 * 128)


def fold_triton(cache, window: DraftWindow, slots: torch.Tensor, accept_lens: torch.Tensor,
                decode_batch: int | None = None, layout: str = DEFAULT_LAYOUT) -> None:
    """Fold on the device: `slots`, `accept_lens` int tensors [B] on the pools' device (no host sync).
    `decode_batch`: the batch whose decode step the state must equal (default B): with P5's launch `layout`
    it picks P5's blocks."""
    if triton is None:
        raise RuntimeError("fold kernel: triton is not installed")
    if window.spec.kind != "replay":
        raise ValueError("the fold kernel folds ReplaySSM windows; snapshot windows are selected by commit")
    ssm = cache.ssm
    _, n_layers, h, kd, vd = ssm.shape
    if ssm.stride(4) != 1 or ssm.stride(3) != vd or ssm.stride(2) != kd * vd:
        raise ValueError("fold kernel: ssm pool [slot, layer] blocks must be row-major")
    for name, t in (("k", window.k), ("v", window.v), ("g", window.g)):
        if not t.is_contiguous():
            raise ValueError(f"fold kernel: window {name} must be contiguous")
    if window.g.stride() != window.k.stride() or window.v.stride() != window.k.stride():
        raise ValueError("fold kernel: window k, v and g need one layout (K == V)")
    b = slots.shape[0]
    if b == 0:
        return
    bk = triton.next_power_of_2(kd)
    launch = kda_launch(layout, decode_batch or b, h, kd, vd)  # P5's blocks: the same layout, the same reductions
    ks, bs = window.k.stride(), window.beta.stride()
    _fold_kernel[(b * n_layers * h,)](
        ssm, ssm.stride(0), ssm.stride(1),
        window.k, window.v, window.g, window.beta,
        ks[0], ks[1], ks[2], bs[0], bs[1], bs[2],
        slots, accept_lens.to(torch.int32),
        N_LAYERS=n_layers, H=h, K=kd, V=vd, BK=bk, BV=launch.block_v, L2EPS=L2_EPS, num_warps=launch.num_warps,
        enable_fp_fusion=False)  # as P5: no a*b+c contracted into an FMA, so both round alike


def commit(cache, window: DraftWindow, slots: list[int], accept_lens: list[int], use_kernel: bool | None = None,
           decode_batch: int | None = None, layout: str = DEFAULT_LAYOUT) -> None:
    """Keep each request's accepted prefix: fold (replay) or select (snapshot), then roll the conv windows.
    `use_kernel` None: the Triton fold on CUDA, the torch reference elsewhere; `decode_batch`, `layout`: see fold_triton."""
    check_commit(window, slots, accept_lens)
    check_layout(layout)
    dev = cache.ssm.device
    if use_kernel is None:
        use_kernel = dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    if window.spec.kind == "replay" and use_kernel and kernel_supports(window):
        fold_triton(cache, window, torch.as_tensor(slots, dtype=torch.int64, device=dev),
                    torch.as_tensor(accept_lens, dtype=torch.int32, device=dev), decode_batch, layout)
        roll_conv(cache, window, slots, accept_lens)
        return
    commit_reference(cache, window, slots, accept_lens)
