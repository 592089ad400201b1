"""MLA decode's query absorption (W_UK) as a Triton GEMV with PDL, in place of cuBLAS's batched GEMM.

`torch.ops.k3.mla_absorb_q(q_nope, kv_b_weight, nope, pdl) -> q_lat_nope [B, H, r]`:

    q_lat_nope[b, h, :] = q_nope[b, h, :] @ W_UK[h]      W_UK = kv_b_proj.weight.unflatten(0, (H, -1))[:, :nope]

the einsum("bhd,hdr->bhr", ...) of `MLAMixer.forward` in decode (spec §6.1), fp32 sums, rounded to q's dtype. The
result is contiguous [B, H, r]: the layout `_decode_split_kernel` reads. q_nope may be a strided view (the nope
columns of the query GEMM's output); its rows must be contiguous or it is copied.

Why not cuBLAS: at batch 1-8 the GEMM is 32 tiny products (one per head) whose cost is the W_UK read (H x nope x r
x 2 B = 4 MB at the 48B shape) and the launch; cuBLAS's kernel has no PDL, so it breaks the chain prologue ->
attention and the split kernel cannot launch early. Here one program owns one head and BLOCK_R latent columns: it
loads its W_UK tile [nope, BLOCK_R] (a weight) before `gdc_wait`, so with PDL the load overlaps the prologue kernel
before it, then reads q for every token and releases its dependents (the split kernel) once q is read.

`torch.ops.k3.mla_decode_prologue_absorb(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_nope,
kv_b_weight, nope, pdl) -> q_lat_nope`: where the query does not come out of the prologue (Kimi Linear: no q-LoRA),
the prologue (kernels/mla_decode.py) and the absorption in one launch, programs 0..B-1 doing the prologue's tokens
and the rest the absorption's (head, column block)s: one kernel boundary fewer per MLA layer.

Above MAX_TOKENS tokens the ops keep the batched GEMM (W_UK read once per head, not once per token block): a
static shape, so a captured graph always takes the same branch. CPU runs the reference; TRITON_INTERPRET=1 runs the
kernel on CPU tensors (tests/passes/kernels/interpret_mla_absorb.py).
"""
from __future__ import annotations

import torch

from . import mla_decode
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the reference
    triton = None

BLOCK_R = 64  # latent columns per program: at the 48B shape 32 heads x 512 / 64 = 256 programs, 16 KB of W_UK each
MAX_TOKENS = 8  # up to this many tokens the Triton kernel; above, the batched GEMM


def w_uk_of(kv_b_weight: torch.Tensor, heads: int, nope: int) -> torch.Tensor:
    """W_UK [H, nope, r] as a view of kv_b_proj's weight [H * (nope + dv), r] (what MLAMixer slices)."""
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] % heads or not 0 < nope < kv_b_weight.shape[0] // heads:
        raise ValueError(f"mla_absorb_q: kv_b_proj weight {tuple(kv_b_weight.shape)} is not "
                         f"[{heads} heads x (nope={nope} + dv), r]")
    return kv_b_weight.unflatten(0, (heads, -1))[:, :nope]


def check_absorb_args(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> None:
    if q_nope.dim() != 3 or q_nope.shape[-1] != nope:
        raise ValueError(f"mla_absorb_q: q_nope must be [B, H, nope={nope}], got {tuple(q_nope.shape)}")
    w_uk_of(kv_b_weight, q_nope.shape[1], nope)
    if kv_b_weight.stride(-1) != 1:
        raise ValueError("mla_absorb_q: kv_b_proj's weight rows must be contiguous")


def absorb_reference(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> torch.Tensor:
    """MLAMixer's einsum("bhd,hdr->bhr", q_nope, W_UK): [B, H, r]."""
    check_absorb_args(q_nope, kv_b_weight, nope)
    return torch.einsum("bhd,hdr->bhr", q_nope, w_uk_of(kv_b_weight, q_nope.shape[1], nope))


if triton is not None:

    @triton.jit
    def _absorb_block(h, cb, q_ptr, q_sb, q_sh, w_ptr, w_sh, w_sd, out_ptr, B, H,
                      R: tl.constexpr, NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                      USE_PDL: tl.constexpr):
        """out[b, h, cols] = sum_d q[b, h, d] W_UK[h, d, cols] for every token b, cols the cb-th BLOCK_R columns."""
        cols = cb * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, NOPE_PAD)
        dm = d < NOPE
        # W_UK is a weight: with PDL its tile loads while the kernel before us still runs
        w = tl.load(w_ptr + h * w_sh + d[:, None] * w_sd + cols[None, :], mask=dm[:, None], other=0.0)
        w = w.to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # q comes from the input GEMM
        for b in range(0, B):
            q = tl.load(q_ptr + b * q_sb + h * q_sh + d, mask=dm, other=0.0).to(tl.float32)
            y = tl.sum(q[:, None] * w, axis=0)
            tl.store(out_ptr + (b * H + h) * R + cols, y.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _absorb_q_kernel(q_ptr, q_sb, q_sh, w_ptr, w_sh, w_sd, out_ptr, B, H,
                         R: tl.constexpr, NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                         USE_PDL: tl.constexpr):
        # program (head h, block of BLOCK_R latent columns)
        _absorb_block(tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, q_sb, q_sh, w_ptr, w_sh, w_sd, out_ptr,
                      B, H, R, NOPE, NOPE_PAD, BLOCK_R, USE_PDL)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the split kernel's wait still covers our stores

    @triton.jit
    def _prologue_absorb_kernel(
        ckv_ptr, ckv_stride, kv_w_ptr, kv_eps, pool_ptr, pool_stride_page, pool_stride_slot, loc_ptr,
        q_ptr, q_sb, q_sh, w_ptr, w_sh, w_sd, out_ptr, B, H,
        R: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, ROW_DTYPE: tl.constexpr, BLOCK_ROPE: tl.constexpr,
        NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        # programs 0..B-1: the prologue of token pid (kv norm + KV page write); the others: the absorption's
        # (head, column block) programs. Independent halves (both read only the input GEMM's output), one launch.
        pid = tl.program_id(0)
        if pid < B:
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
            mla_decode.prologue_row(pid.to(tl.int64), ckv_ptr, ckv_stride, kv_w_ptr, kv_eps, pool_ptr,
                                    pool_stride_page, pool_stride_slot, loc_ptr, R, ROPE, PAGE, ROW_DTYPE, R,
                                    BLOCK_ROPE)
        else:
            blocks = R // BLOCK_R
            a = pid - B
            _absorb_block((a // blocks).to(tl.int64), a % blocks, q_ptr, q_sb, q_sh, w_ptr, w_sh, w_sd, out_ptr, B,
                          H, R, NOPE, NOPE_PAD, BLOCK_R, USE_PDL)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()


def absorb_triton(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, nope: int, pdl: bool = False,
                  block_r: int = BLOCK_R, num_warps: int = 4) -> torch.Tensor:
    """Launch the absorption kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): [B, H, r] contiguous."""
    check_absorb_args(q_nope, kv_b_weight, nope)
    if triton is None:
        raise RuntimeError("mla_absorb_q: triton is not installed")
    B, H, _ = q_nope.shape
    r = kv_b_weight.shape[1]
    block_r = min(block_r, r)
    if r % block_r or block_r != triton.next_power_of_2(block_r):
        raise ValueError(f"mla_absorb_q kernel: block_r must be a power of two dividing r = {r}, got {block_r}")
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    w_uk = w_uk_of(kv_b_weight, H, nope)
    out = torch.empty(B, H, r, dtype=q_nope.dtype, device=q_nope.device)
    if B == 0:
        return out
    pdl = pdl_for(pdl, q_nope)
    extra = {"launch_pdl": True} if pdl else {}
    _absorb_q_kernel[(H, r // block_r)](
        q_nope, q_nope.stride(0), q_nope.stride(1), w_uk, w_uk.stride(0), w_uk.stride(1), out, B, H,
        R=r, NOPE=nope, NOPE_PAD=triton.next_power_of_2(nope), BLOCK_R=block_r, USE_PDL=pdl, num_warps=num_warps,
        **extra)
    return out


def prologue_absorb_triton(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_nope, kv_b_weight, nope: int,
                           pdl: bool = False, block_r: int = BLOCK_R, num_warps: int = 4) -> torch.Tensor:
    """The MLA prologue without q-LoRA (Kimi Linear: the query comes from the input GEMM, not from the prologue's
    q_a norm) and the W_UK absorption in one launch: `k3.mla_decode_prologue(...)` then `k3.mla_absorb_q(...)`;
    returns q_lat_nope [B, H, r] (`k3.mla_decode_prologue_absorb`, P15's absorb_q="fold")."""
    mla_decode.check_prologue_args(ckv, kv_norm_weight, kv_pool, layer, out_cache_loc, None, None)
    check_absorb_args(q_nope, kv_b_weight, nope)
    if triton is None:
        raise RuntimeError("mla prologue + absorption: triton is not installed")
    n, width = ckv.shape
    B, H, _ = q_nope.shape
    r = kv_b_weight.shape[1]
    if n != B or kv_norm_weight.shape[0] != r:
        raise ValueError(f"mla prologue + absorption: {n} ckv rows and r = {kv_norm_weight.shape[0]} must match the "
                         f"query's {B} tokens and kv_b_proj's r = {r}")
    block_r = min(block_r, r)  # a small latent (k3-tiny's r = 16) is one column block
    if r % block_r or block_r != triton.next_power_of_2(block_r) or r != triton.next_power_of_2(r):
        raise ValueError(f"mla prologue + absorption kernel: r = {r} and block_r = {block_r} must be powers of two, "
                         f"block_r dividing r")
    if ckv.stride(-1) != 1:
        ckv = ckv.contiguous()
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    if kv_pool.stride(-1) != 1:
        raise ValueError("mla prologue + absorption: the pool's rows must be contiguous")
    out = torch.empty(B, H, r, dtype=q_nope.dtype, device=q_nope.device)
    if B == 0:
        return out
    w_uk = w_uk_of(kv_b_weight, H, nope)
    layer_view = kv_pool[:, layer]
    pdl = pdl_for(pdl, q_nope)
    extra = {"launch_pdl": True} if pdl else {}
    _prologue_absorb_kernel[(B + H * (r // block_r),)](
        ckv, ckv.stride(0), kv_norm_weight, float(kv_eps), layer_view, layer_view.stride(0), layer_view.stride(1),
        out_cache_loc, q_nope, q_nope.stride(0), q_nope.stride(1), w_uk, w_uk.stride(0), w_uk.stride(1), out, B, H,
        R=r, ROPE=width - r, PAGE=kv_pool.shape[2],
        ROW_DTYPE=mla_decode._TL_DTYPES[torch.promote_types(kv_norm_weight.dtype, ckv.dtype)],
        BLOCK_ROPE=triton.next_power_of_2(width - r), NOPE=nope, NOPE_PAD=triton.next_power_of_2(nope),
        BLOCK_R=block_r, USE_PDL=pdl, num_warps=num_warps, **extra)
    return out


def kernel_supports_absorb(r: int, tokens: int) -> bool:
    return triton is not None and r >= 16 and r % min(BLOCK_R, r) == 0 and r == triton.next_power_of_2(r) \
        and tokens <= MAX_TOKENS


@torch.library.custom_op("k3::mla_absorb_q", mutates_args=())
def mla_absorb_q(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, nope: int, pdl: bool) -> torch.Tensor:
    """q_nope [B, H, nope] @ W_UK per head -> [B, H, r] contiguous; see module doc."""
    return absorb_reference(q_nope, kv_b_weight, nope).contiguous()


@mla_absorb_q.register_kernel("cuda")
def _absorb_cuda(q_nope, kv_b_weight, nope, pdl):
    if not kernel_supports_absorb(kv_b_weight.shape[1], q_nope.shape[0]):  # static shapes: one branch per graph
        return absorb_reference(q_nope, kv_b_weight, nope).contiguous()
    with torch.cuda.device(q_nope.device):
        return absorb_triton(q_nope, kv_b_weight, nope, pdl_for(pdl, q_nope))


@mla_absorb_q.register_fake
def _absorb_fake(q_nope, kv_b_weight, nope, pdl):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], kv_b_weight.shape[1])


@torch.library.custom_op("k3::mla_decode_prologue_absorb", mutates_args=("kv_pool",))
def mla_decode_prologue_absorb(ckv: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, kv_pool: torch.Tensor,
                               layer: int, out_cache_loc: torch.Tensor, q_nope: torch.Tensor,
                               kv_b_weight: torch.Tensor, nope: int, pdl: bool) -> torch.Tensor:
    """k3.mla_decode_prologue without q-LoRA, then k3.mla_absorb_q: one launch (P15's absorb_q="fold")."""
    mla_decode.prologue_reference(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc)
    return absorb_reference(q_nope, kv_b_weight, nope).contiguous()


@mla_decode_prologue_absorb.register_kernel("cuda")
def _prologue_absorb_cuda(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_nope, kv_b_weight, nope, pdl):
    r = kv_b_weight.shape[1]
    if not kernel_supports_absorb(r, q_nope.shape[0]) or kv_norm_weight.shape[0] != r:
        torch.ops.k3.mla_decode_prologue(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, None, None, 0.0,
                                         pdl)
        return torch.ops.k3.mla_absorb_q(q_nope, kv_b_weight, nope, pdl)
    with torch.cuda.device(q_nope.device):
        return prologue_absorb_triton(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_nope, kv_b_weight,
                                      nope, pdl_for(pdl, q_nope))


@mla_decode_prologue_absorb.register_fake
def _prologue_absorb_fake(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_nope, kv_b_weight, nope, pdl):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], kv_b_weight.shape[1])
