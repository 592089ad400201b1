"""P7's residual add + AttnRes read + RMSNorm and P4's absorbed router in one op (pass p07_norm_route).

`torch.ops.k3.norm_route(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight,
top_k, renormalize, scaling, num_expert_group, topk_group, max_tokens) -> (h, p, topk_weights, topk_ids)`
is exactly the composition the graph runs before the MoE once P4 and P7 have fused it:

    h, p, h32 = k3.attn_res_norm_f32(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl)
    w, ids    = k3.fused_route(h32, bias, top_k, renormalize, scaling, G, topk_group, W, max_tokens)

(h32 = h.float(): the router's logits are mm(h.float(), W.float().t()), fp32.) The router weight W may be
kept in its checkpoint dtype (bf16): W.float() is exact, so the logits are the same as from P3's fp32 copy
and the op reads half the bytes. CPU (and any device without the kernel) runs the two references one after
the other, so an engine with the pass computes bit for bit what one without it does.

CUDA, T <= max_tokens: one launch, `_norm_route_kernel`, grid (expert block, token). Every program loads its
BLOCK_E rows of W and the norm's weights first (static: with PDL this overlaps the previous kernel), waits
for the previous kernel (`gdc_wait`), recomputes the token's h (the row is a few KB, L2-hot after the first
program; every program runs the same code on the same inputs, so each gets the same bits) and releases its
dependents; the expert block 0 program stores h and p; each computes its experts' fp32 logits into a
workspace row and the token's last program to arrive (kernels.arrivals counters, acq_rel, zeroed again by
it) routes the row as `k3::fused_route` does (routing._store_logits_and_route). The bank is read as one
register tile (P7's one-pass form), so the fused kernel covers banks that fit it (`bank_fits_tile`: every
k3-mini and Kimi-Linear shape) and no bank at all; other shapes, and T > max_tokens, run today's pair
(P7's kernel with its fp32 copy, then the router GEMM on cuBLAS and the routing kernel).

Launch options (P7's; its default tail is "bitonic", measured whole-engine in traces/h200_s11/call3): `tail`
picks the last program's routing (routing.ROUTE_TAILS: "rounds", the op's default; "lean", no second read of the
row and no wait on the counter reset; "bitonic", lean with a tl.topk network instead of k argmax rounds),
`target_programs` the grid's size (default_blocks). Every choice gives the same h, p and ids, and the same weights up to the order of the k-sum.

`torch.ops.k3.norm_route_gemv(<norm_route's arguments, tail and target_programs included>, w, <k3.gemv's
configuration: max_m .. upper>, fused_max_tokens, front_block=0) -> (h, p, topk_weights, topk_ids, y)`
(pass p08_small_m_route_gemv) is that op followed by `y = k3.gemv(h, w, None, ...)`, the K3 MoE's front GEMV (its
latent down-projection and the shared expert's gate/up on h). Where the fused kernel runs (and T <=
fused_max_tokens), the same launch has cdiv(NF, BLOCK_F) more programs per token after the expert blocks: each loads
its [BLOCK_F, D] rows of w before its wait, recomputes h as the router's programs do and stores its rows of y (fp32
sums of the bf16 products, rounded once: k3.gemv's product up to the order of the sum). So the router's routing
tail and the front GEMV run side by side, and the graph loses one launch per MoE layer. Elsewhere the op is exactly
the two ops. Without a front (BLOCK_F 0) the kernel is the router's code alone, as before the op existed.

Testing without a GPU: TRITON_INTERPRET=1 in the environment before this module is imported makes
`norm_route_triton` run on CPU tensors (tests/passes/kernels/interpret_norm_route.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import attn_res_norm as arn
from . import gemv as _gemv  # noqa: F401  (registers torch.ops.k3.gemv, norm_route_gemv's second half)
from . import routing
from .arrivals import arrival_counters
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the references
    triton = None

ARRIVALS_OWNER = "norm_route"  # this kernel's own arrival counters (arrivals.py)
TARGET_PROGRAMS = 128  # as P4's absorbed kernel: enough programs to keep the SMs reading W at batch 1
MAX_BLOCK_E = 16
MAX_TILE = 16384  # router-weight elements of one program's [BLOCK_E, BLOCK_D] tile, held in registers
MAX_FRONT_BLOCK = 64  # norm_route_gemv's rows per program at most (a [64, D] tile already spills at D=2048)
FUSED_MAX_TOKENS = 8  # above, today's pair: at 48B batch 16 the fused kernel lost (12.6 vs 11.7 us, H200 sweep)


def check_args(bank, x, delta, query, norm_weight, bias, router_weight, top_k, num_expert_group,
               topk_group) -> None:
    """Raise ValueError naming the first thing wrong with a call (both halves' checks)."""
    arn.check_args(bank, x, delta, query, norm_weight)
    routing.check_linear_route_args(x, router_weight, bias, top_k, num_expert_group, topk_group)


# --------------------------------------------------------------------------- CPU reference

def norm_route_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps, bias, router_weight, top_k,
                         renormalize, scaling, num_expert_group=1, topk_group=1):
    """(h, p, topk_weights, topk_ids): P7's reference, then P4's absorbed reference on h.float()."""
    check_args(bank, x, delta, query, norm_weight, bias, router_weight, top_k, num_expert_group, topk_group)
    h, p = arn.attn_res_norm_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps)
    weights, ids = routing.linear_route_reference(h.float(), router_weight, bias, top_k, renormalize, scaling,
                                                  num_expert_group, topk_group)
    return h, p, weights, ids


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:
    from .attn_res_norm import _bank_tile_ptrs, _residual_add, _rms_norm_row, _tile_mix
    from .routing import _store_logits_and_route

    @triton.jit
    def _normed_row(b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr, block,
                    token, D, res_eps, norm_eps, NUM_BANK: tl.constexpr, BANK_PAD: tl.constexpr,
                    BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr, USE_PDL: tl.constexpr):
        """The token's h (in h_ptr's dtype, [BLOCK_D]): every program recomputes it from the same inputs, so all
        get the same bits; the block-0 program stores h and p. Waits for the previous kernel first (PDL), and
        releases the next one once its inputs are read; the caller loads its static weight tile before."""
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        base = token * D + cols  # every [N, D] tensor is contiguous (the wrapper makes sure)
        nw = tl.load(norm_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if NUM_BANK > 0:
            q = tl.load(query_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # x, delta and the bank rows come from earlier kernels
        if NUM_BANK > 0:
            ridx = tl.arange(0, BANK_PAD)
            rows = tl.multiple_of(_bank_tile_ptrs(ridx[:, None], NUM_BANK, b0, b1, b2, b3, b4, b5, b6, b7), [16, 1])
            live = ridx < NUM_BANK
            r = tl.load(rows + base[None, :], mask=live[:, None] & m[None, :], other=0.0).to(tl.float32)
        owner = m & ((block + cols * 0) == 0)  # one program per token stores h and p (a [BLOCK_D] mask)
        p = _residual_add(x_ptr, delta_ptr, p_ptr, base, m, owner, HAS_DELTA)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()  # inputs read
        if NUM_BANK > 0:
            mix = _tile_mix(r, live, p, q, D, res_eps)
        else:
            mix = p.to(tl.float32)
        h = _rms_norm_row(mix, p, nw, D, norm_eps, h_ptr.dtype.element_ty)
        tl.store(h_ptr + base, h, mask=owner)
        return h

    @triton.jit
    def _norm_route_kernel(
        b0, b1, b2, b3, b4, b5, b6, b7,
        x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr,
        router_w_ptr, bias_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr, front_w_ptr, front_y_ptr,
        D, NF, res_eps, norm_eps, scaling,
        NUM_BANK: tl.constexpr, BANK_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr,
        USE_PDL: tl.constexpr,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, EXPERT_BLOCKS: tl.constexpr,
        GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
        GROUPS_PAD: tl.constexpr, GROUP_SIZE_PAD: tl.constexpr, TOP_K_PAD: tl.constexpr, TAIL: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        # grid (EXPERT_BLOCKS + front blocks, token): the router's expert blocks, then (norm_route_gemv only, BLOCK_F
        # > 0) the front GEMV's row blocks. Without a front the kernel is the router's code alone (no branch).
        block = tl.program_id(0)
        token = tl.program_id(1).to(tl.int64)
        if BLOCK_F == 0:
            _router_program(b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr,
                            router_w_ptr, bias_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr, block, token, D,
                            res_eps, norm_eps, scaling, NUM_BANK, BANK_PAD, BLOCK_D, HAS_DELTA, USE_PDL, NUM_EXPERTS,
                            BLOCK_E, EXPERT_BLOCKS, GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, TOP_K, RENORMALIZE,
                            GROUPS_PAD, GROUP_SIZE_PAD, TOP_K_PAD, TAIL)
        elif block < EXPERT_BLOCKS:
            _router_program(b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr,
                            router_w_ptr, bias_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr, block, token, D,
                            res_eps, norm_eps, scaling, NUM_BANK, BANK_PAD, BLOCK_D, HAS_DELTA, USE_PDL, NUM_EXPERTS,
                            BLOCK_E, EXPERT_BLOCKS, GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, TOP_K, RENORMALIZE,
                            GROUPS_PAD, GROUP_SIZE_PAD, TOP_K_PAD, TAIL)
        else:
            f = (block - EXPERT_BLOCKS) * BLOCK_F + tl.arange(0, BLOCK_F)
            f_ok = f < NF
            y = _rows_times_h(front_w_ptr, f, f_ok, b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr,
                              norm_w_ptr, h_ptr, p_ptr, block, token, D, res_eps, norm_eps, NUM_BANK, BANK_PAD, BLOCK_D,
                              HAS_DELTA, USE_PDL)
            # k3.gemv's product: fp32 sums of the 16-bit products, rounded once to the output dtype
            tl.store(front_y_ptr + token * NF + f, y.to(front_y_ptr.dtype.element_ty), mask=f_ok)

    @triton.jit
    def _rows_times_h(w_ptr, rows, rows_ok, b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr,
                      h_ptr, p_ptr, block, token, D, res_eps, norm_eps, NUM_BANK: tl.constexpr,
                      BANK_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr, USE_PDL: tl.constexpr):
        """W[rows] . h in fp32 (the 16-bit products summed in fp32, no TF32), h from `_normed_row`. W's [rows, D]
        tile is static, so it loads first: with PDL these loads overlap the previous kernel's tail."""
        cols = tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * D + cols[None, :],
                    mask=rows_ok[:, None] & (cols < D)[None, :], other=0.0)
        h = _normed_row(b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr,
                        block, token, D, res_eps, norm_eps, NUM_BANK, BANK_PAD, BLOCK_D, HAS_DELTA, USE_PDL)
        return tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)

    @triton.jit
    def _router_program(b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr,
                        router_w_ptr, bias_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr, block, token, D,
                        res_eps, norm_eps, scaling, NUM_BANK: tl.constexpr, BANK_PAD: tl.constexpr,
                        BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr, USE_PDL: tl.constexpr,
                        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, EXPERT_BLOCKS: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
                        GROUP_SIZE_PAD: tl.constexpr, TOP_K_PAD: tl.constexpr, TAIL: tl.constexpr):
        """One expert block of the token's router: its rows' fp32 logits, and the routing if it arrives last."""
        e = block * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < NUM_EXPERTS
        # the router reads h.float() (the graph's cast) and W.float(): fp32 multiply-adds, no TF32
        logits = _rows_times_h(router_w_ptr, e, e_ok, b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr,
                               norm_w_ptr, h_ptr, p_ptr, block, token, D, res_eps, norm_eps, NUM_BANK, BANK_PAD,
                               BLOCK_D, HAS_DELTA, USE_PDL)
        _store_logits_and_route(logits, e, e_ok, token, logits_ptr, arrivals_ptr, bias_ptr, weights_ptr, ids_ptr,
                                scaling, NUM_EXPERTS, EXPERT_BLOCKS, GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, TOP_K,
                                RENORMALIZE, GROUPS_PAD, GROUP_SIZE_PAD, TOP_K_PAD, TAIL)


def kernel_supports(bank, x, router_weight, top_k) -> bool:
    """Shapes the fused kernel covers: P7's one-pass bank tile (or no bank) and the routing tile's limits."""
    if triton is None or not routing.kernel_supports(router_weight.shape[0], top_k):
        return False
    d = x.shape[1]
    if d > arn.KERNEL_MAX_DIM or triton.next_power_of_2(d) > MAX_TILE:
        return False
    return not bank or arn.one_pass_applies(bank, x)


def default_blocks(num_tokens: int, num_experts: int, dim: int, num_bank: int,
                   target_programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(BLOCK_E, num_warps) from static shapes only (a CUDA graph replays one grid per batch size): experts per
    program doubled while the grid keeps >= target_programs programs and the W tile fits MAX_TILE (a smaller
    target: fewer, wider programs, so fewer arrivals before the token's last program routes)."""
    block_d = triton.next_power_of_2(dim)
    block_e = 1
    while (block_e * 2 <= MAX_BLOCK_E and block_e * 2 <= num_experts and block_e * 2 * block_d <= MAX_TILE
           and num_tokens * triton.cdiv(num_experts, block_e * 2) >= target_programs):
        block_e *= 2
    # 4 warps: best at every shape and batch the H200 sweep tried (48B and k3-mini-6b, batch 1-16, BLOCK_E 1-8;
    # traces/h200_s8/route8.md), by up to 2.2x over the 8-16 warps the tile size would suggest
    return block_e, 4


def norm_route_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, bias, router_weight, top_k,
                      renormalize, scaling, num_expert_group=1, topk_group=1, pdl: bool = False,
                      block_e: int | None = None, num_warps: int | None = None, tail: str = "rounds",
                      target_programs: int = TARGET_PROGRAMS, front_weight: torch.Tensor | None = None,
                      front_block: int | None = None):
    """Launch the fused kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): (h, p, weights, ids).
    block_e / num_warps override `default_blocks` (benchmarks), target_programs is its target (P7's option).
    tail: the last-arriving program's routing tail, a key of routing.ROUTE_TAILS (P7's tail option; every tail
    gives the same ids and weights). front_weight [NF, D] (norm_route_gemv): the same launch also computes
    y = h @ front_weight.T in more programs of front_block rows (default `front_rows`) and returns (h, p, weights,
    ids, y); the router's programs and outputs are the same as without it."""
    check_args(bank, x, delta, query, norm_weight, bias, router_weight, top_k, num_expert_group, topk_group)
    if front_weight is not None:
        check_front(x, norm_weight, front_weight)
    if triton is None:
        raise RuntimeError("norm_route: triton is not installed")
    tail_code = routing.tail_code(tail)
    bank = [r.contiguous() for r in bank]
    x = x.contiguous()
    if not kernel_supports(bank, x, router_weight, top_k):
        raise ValueError(f"norm_route kernel: no fused kernel for dim {x.shape[1]}, {len(bank)} bank rows, "
                         f"{router_weight.shape[0]} experts, top_k {top_k} (bank tile too large, a row not "
                         f"16-byte aligned, or past the routing kernel's limits)")
    n, d = x.shape
    num_experts = router_weight.shape[0]
    delta = x if delta is None else delta.contiguous()  # delta None: unused pointer slot
    h = torch.empty(n, d, dtype=arn._out_dtype(x, norm_weight), device=x.device)
    p = torch.empty_like(x)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    nf = 0 if front_weight is None else front_weight.shape[0]
    y = None if front_weight is None else torch.empty(n, nf, dtype=front_weight.dtype, device=x.device)
    if n == 0:
        return (h, p, weights, ids) if y is None else (h, p, weights, ids, y)
    be, nw = default_blocks(n, num_experts, d, len(bank), target_programs)
    be, nw = block_e or be, num_warps or nw
    if be & (be - 1):
        raise ValueError(f"norm_route kernel: block_e ({be}) must be a power of two")
    expert_blocks = triton.cdiv(num_experts, be)
    logits = torch.empty(n, num_experts, dtype=torch.float32, device=x.device)  # workspace
    arrivals = arrival_counters(x.device, n, ARRIVALS_OWNER) if expert_blocks > 1 else logits  # (unused at 1)
    pdl = pdl_for(pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    rows = bank + [x] * (arn.MAX_BANK - len(bank))  # unused pointer slots: any valid tensor
    bf = 0 if y is None else (front_block or front_rows(d, nf))
    if bf & (bf - 1):
        raise ValueError(f"norm_route kernel: front_block ({bf}) must be a power of two")
    front_blocks = 0 if y is None else triton.cdiv(nf, bf)  # bf 0: the router's kernel alone
    _norm_route_kernel[(expert_blocks + front_blocks, n)](
        *rows, x, delta, query.contiguous() if query is not None else norm_weight, norm_weight.contiguous(), h, p,
        router_weight.contiguous(), bias.contiguous(), logits, arrivals, weights, ids,
        h if y is None else front_weight.contiguous(), h if y is None else y,  # no front: unused pointer slots
        d, nf, float(res_eps), float(norm_eps), float(scaling),
        NUM_BANK=len(bank), BANK_PAD=triton.next_power_of_2(max(len(bank), 1)), BLOCK_D=triton.next_power_of_2(d),
        HAS_DELTA=delta is not x, USE_PDL=pdl, NUM_EXPERTS=num_experts, BLOCK_E=be, EXPERT_BLOCKS=expert_blocks,
        **routing._route_constants(num_experts, top_k, renormalize, num_expert_group, topk_group), TAIL=tail_code,
        BLOCK_F=bf, num_warps=nw, **extra)
    return (h, p, weights, ids) if y is None else (h, p, weights, ids, y)


def front_rows(dim: int, rows: int) -> int:
    """Rows of the front weight per program: a [rows, D] tile of 2 * MAX_TILE elements (16 rows at D = 2048), at most
    the weight's rows rounded up to a power of two. Why twice the router's tile: the launch's register count is the
    larger branch's, and at k3-mini-6b (4 warps, ptxas for sm_90a from Triton 3.9's PTX) 8 rows took 249 registers a
    thread (2 programs an SM: 96 router + 256 front programs are 1.3 waves on 132 SMs), 16 rows 255 with 50 bytes of
    spill (224 programs, one wave), 4 rows 167 (3 an SM, 608 programs: 1.5 waves). To be measured (gpu_s17.sh)."""
    return max(1, min(2 * MAX_TILE // triton.next_power_of_2(dim), triton.next_power_of_2(max(rows, 1))))


def check_front_launch(fused_max_tokens: int, front_block: int) -> None:
    """Raise ValueError naming a bad launch option of norm_route_gemv."""
    if fused_max_tokens < 0:
        raise ValueError(f"norm_route_gemv: fused_max_tokens must be >= 0, got {fused_max_tokens}")
    if front_block < 0 or front_block & (front_block - 1) or front_block > MAX_FRONT_BLOCK:
        raise ValueError(f"norm_route_gemv: front_block must be 0 (default) or a power of two up to "
                         f"{MAX_FRONT_BLOCK}, got {front_block}")


def check_front(x: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor) -> None:
    """Raise ValueError naming what is wrong with a front weight for h = norm(x): [NF, D] in h's dtype."""
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"norm_route_gemv: the front weight must be [N, D = {x.shape[1]}], got {tuple(w.shape)}")
    if w.dtype != arn._out_dtype(x, norm_weight):
        raise ValueError(f"norm_route_gemv: the front weight ({w.dtype}) and h "
                         f"({arn._out_dtype(x, norm_weight)}) must share a dtype")
    if w.device != x.device:
        raise ValueError(f"norm_route_gemv: the front weight is on {w.device}, x on {x.device}")


# --------------------------------------------------------------------------- the k3 op

@torch.library.custom_op("k3::norm_route", mutates_args=())
def norm_route(bank: list[torch.Tensor], x: torch.Tensor, delta: torch.Tensor | None, query: torch.Tensor | None,
               norm_weight: torch.Tensor, res_eps: float, norm_eps: float, pdl: bool, bias: torch.Tensor,
               router_weight: torch.Tensor, top_k: int, renormalize: bool, scaling: float, num_expert_group: int,
               topk_group: int, max_tokens: int, tail: str = "rounds",
               target_programs: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, p, topk_weights, topk_ids): k3::attn_res_norm then k3::fused_route on h.float(). See module doc.
    tail / target_programs: the fused kernel's launch (P7's options of the same names; target_programs 0:
    TARGET_PROGRAMS); the results do not depend on them."""
    return norm_route_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps, bias, router_weight, top_k,
                                renormalize, scaling, num_expert_group, topk_group)


def _fused_applies(bank, x, router_weight, top_k, max_tokens: int) -> bool:
    """Whether CUDA runs the fused kernel for this call: at most min(max_tokens, FUSED_MAX_TOKENS) tokens, and shapes
    the kernel takes."""
    return (x.shape[0] <= min(max_tokens, FUSED_MAX_TOKENS)
            and kernel_supports([r.contiguous() for r in bank], x.contiguous(), router_weight, top_k))


@norm_route.register_kernel("cuda")
def _norm_route_cuda(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                     renormalize, scaling, num_expert_group, topk_group, max_tokens, tail="rounds", target_programs=0):
    route = (top_k, renormalize, scaling, num_expert_group, topk_group)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        if _fused_applies(bank, x, router_weight, top_k, max_tokens):
            return norm_route_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, bias, router_weight,
                                     *route, pdl=pdl, tail=tail, target_programs=target_programs or TARGET_PROGRAMS)
        # today's pair: P7's kernel with h's fp32 copy, then the router GEMM (cuBLAS) and the routing kernel
        check_args(bank, x, delta, query, norm_weight, bias, router_weight, top_k, num_expert_group, topk_group)
        h, p, h32 = torch.ops.k3.attn_res_norm_f32(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl)
        weights, ids = torch.ops.k3.fused_route(h32, bias, *route, router_weight, 0)
        return h, p, weights, ids


@norm_route.register_fake
def _norm_route_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                     renormalize, scaling, num_expert_group, topk_group, max_tokens, tail="rounds", target_programs=0):
    check_args(bank, x, delta, query, norm_weight, bias, router_weight, top_k, num_expert_group, topk_group)
    n = x.shape[0]
    return (x.new_empty(x.shape, dtype=arn._out_dtype(x, norm_weight)), torch.empty_like(x),
            x.new_empty(n, top_k, dtype=torch.float32), x.new_empty(n, top_k, dtype=torch.int64))


# --------------------------------------------------------------------------- the op with the MoE front GEMV

@torch.library.custom_op("k3::norm_route_gemv", mutates_args=())
def norm_route_gemv(bank: list[torch.Tensor], x: torch.Tensor, delta: torch.Tensor | None,
                    query: torch.Tensor | None, norm_weight: torch.Tensor, res_eps: float, norm_eps: float, pdl: bool,
                    bias: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
                    num_expert_group: int, topk_group: int, max_tokens: int, tail: str, target_programs: int,
                    w: torch.Tensor, max_m: int, block_n: int, block_k: int, split_k: int, design: int,
                    gemv_pdl: bool, num_warps: int, l2_prefetch_kb: int, early_release: bool,
                    upper: Optional[list[int]], fused_max_tokens: int, front_block: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, p, topk_weights, topk_ids, y): k3::norm_route, then k3::gemv(h, w, None, max_m .. upper) -- the K3 MoE's
    front GEMV (latent down-projection and shared gate/up) on the normed row. CPU, and CUDA above
    min(max_tokens, FUSED_MAX_TOKENS, fused_max_tokens) tokens or where the kernel does not take the shapes, run
    exactly those two ops; otherwise one launch of `_norm_route_kernel` whose extra programs compute y (pass
    p08_small_m_route_gemv). front_block: the front's rows per program (a power of two; 0: `front_rows`), which does
    not change the results."""
    return _route_then_gemv(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                            renormalize, scaling, num_expert_group, topk_group, max_tokens, tail, target_programs, w,
                            max_m, block_n, block_k, split_k, design, gemv_pdl, num_warps, l2_prefetch_kb,
                            early_release, upper, fused_max_tokens, front_block)


def _route_then_gemv(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                     renormalize, scaling, num_expert_group, topk_group, max_tokens, tail, target_programs, w, max_m,
                     block_n, block_k, split_k, design, gemv_pdl, num_warps, l2_prefetch_kb, early_release, upper,
                     fused_max_tokens, front_block=0):
    """The two ops the fused one replaces, on whichever device x is (the reference, and CUDA's fallback)."""
    check_front(x, norm_weight, w)
    check_front_launch(fused_max_tokens, front_block)
    h, p, weights, ids = torch.ops.k3.norm_route(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias,
                                                 router_weight, top_k, renormalize, scaling, num_expert_group,
                                                 topk_group, max_tokens, tail, target_programs)
    y = torch.ops.k3.gemv(h, w, None, max_m, block_n, block_k, split_k, design, gemv_pdl, num_warps, l2_prefetch_kb,
                          early_release, upper)
    return h, p, weights, ids, y


@norm_route_gemv.register_kernel("cuda")
def _norm_route_gemv_cuda(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                          renormalize, scaling, num_expert_group, topk_group, max_tokens, tail, target_programs, w,
                          max_m, block_n, block_k, split_k, design, gemv_pdl, num_warps, l2_prefetch_kb,
                          early_release, upper, fused_max_tokens, front_block=0):
    with torch.cuda.device(x.device):  # Triton launches on the current device
        if _fused_applies(bank, x, router_weight, top_k, min(max_tokens, fused_max_tokens)):
            check_front(x, norm_weight, w)
            check_front_launch(fused_max_tokens, front_block)
            return norm_route_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, bias, router_weight,
                                     top_k, renormalize, scaling, num_expert_group, topk_group, pdl=pdl, tail=tail,
                                     target_programs=target_programs or TARGET_PROGRAMS, front_weight=w,
                                     front_block=front_block or None)
    return _route_then_gemv(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                            renormalize, scaling, num_expert_group, topk_group, max_tokens, tail, target_programs, w,
                            max_m, block_n, block_k, split_k, design, gemv_pdl, num_warps, l2_prefetch_kb,
                            early_release, upper, fused_max_tokens, front_block)


@norm_route_gemv.register_fake
def _norm_route_gemv_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, router_weight, top_k,
                          renormalize, scaling, num_expert_group, topk_group, max_tokens, tail, target_programs, w,
                          max_m, block_n, block_k, split_k, design, gemv_pdl, num_warps, l2_prefetch_kb,
                          early_release, upper, fused_max_tokens, front_block=0):
    check_front(x, norm_weight, w)
    check_front_launch(fused_max_tokens, front_block)
    h, p, weights, ids = _norm_route_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias,
                                          router_weight, top_k, renormalize, scaling, num_expert_group, topk_group,
                                          max_tokens, tail, target_programs)
    return h, p, weights, ids, x.new_empty(x.shape[0], w.shape[0], dtype=w.dtype)
