"""Fused MoE routing: sigmoid + correction bias + (group limit) + top-k + gather + renorm + scale.

This is the op that pass P4 puts in place of the router's chain of small ops. Semantics are those
of Hugging Face `KimiLinearTopkRouter.forward` (DeepSeek-V3 "noaux_tc", spec §2.4), starting from
the router logits z [T, E]:

    s      = sigmoid(z)                      computed in fp32 whatever z's dtype
    choice = s + b                           b: e_score_correction_bias [E]
    if num_expert_group > 1:                 keep the `topk_group` groups whose two best choice
        choice[experts of other groups] = -inf     scores have the largest sum
    ids     = the top_k experts by choice
    weights = s[ids]                         unbiased scores
    if renormalize: weights /= weights.sum() + 1e-20
    weights *= scaling

Contract that transformers leaves open (it uses `topk(sorted=False)`), fixed here so the CPU
reference and the Triton kernel give the same answer:
  * Order within the k: descending choice score; equal choice scores go to the lower expert index.
    Groups are chosen the same way (lower group index wins a tie).
  * A NaN choice score (a NaN logit or bias) ranks above every number, like torch.topk does, so
    the NaN shows up in the weights instead of being hidden.
  * topk_ids are int64: what torch.topk returns and what gather/scatter/index_add/one_hot/bincount
    take without a cast, so expert compute can index with them directly and the fused graph keeps
    the dtypes of the unfused one. The cost over int32 is 64 bytes per token at top-16.
  * topk_weights are fp32. The bias may be any float dtype; it is added in fp32 (as transformers'
    fp32 scores + bf16 buffer promotes). Renormalisation applies for any k when asked, as in
    transformers (spec §2.4 says "only when k > 1"; for k = 1 both give scaling up to 1e-20).
  * Group limiting (num_expert_group > 1) runs in the kernel too, not only in the reference.
  * On CUDA, Triton's sigmoid can differ from torch's by an ulp, so two experts whose choice
    scores are that close may swap; under the interpreter the kernel matches the reference exactly.

`torch.ops.k3.fused_route(logits, bias, top_k, renormalize, scaling, num_expert_group,
topk_group)` is the single graph node a pass targets: all knobs are plain scalars in the
schema, the tensors are exactly the router logits and the bias buffer. CPU (and any device
without a kernel) runs the reference; CUDA runs the Triton kernel.

Absorbed form (P4 with absorb_router_max_tokens > 0): `fused_route(x, bias, ..., router_weight=W,
absorb_max_tokens=N)` takes the router's input x [T, D] and weight W [E, D] (fp32 / bf16 / fp16) and
computes logits = mm(x.float(), W.float().t()) itself (`router_logits`; CPU: exactly that op, then the
reference). On CUDA, T <= N runs `_linear_route_kernel`: a grid over (expert block, token) computes fp32
logits into a workspace (fp32 multiply-adds, no TF32) and the token's last program to arrive (acq_rel
counter, zeroed again by it, so CUDA-graph replays start clean) routes the row; T > N runs cuBLAS, then
the routing kernel. The kernel's dot products sum in another order than cuBLAS, so experts whose choice
scores agree to a few ulps may swap (tests allow exactly that).

Testing the kernel without a GPU: with TRITON_INTERPRET=1 in the environment *before this module
is imported* (the flag is read when the kernel is decorated), `route_triton` runs on CPU tensors.
"""
from __future__ import annotations

import torch

from .arrivals import arrival_counters

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the reference
    triton = None

# Above these the kernel's one-token-per-program tile stops fitting comfortably in registers
# (and we have not tested it); the op then runs the reference on the tensor's own device.
KERNEL_MAX_EXPERTS = 1024
KERNEL_MAX_TOP_K = 16
RENORM_EPS = 1e-20  # as in transformers, so a zero sum gives zeros rather than NaN


# --------------------------------------------------------------------------- argument checks

def check_route_args(logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_expert_group: int,
                     topk_group: int) -> None:
    """Raise ValueError naming the first thing wrong with a routing call."""
    if logits.dim() != 2:
        raise ValueError(f"fused_route: logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"fused_route: logits must be a float tensor, got {logits.dtype}")
    _check_route_knobs(logits.shape[1], logits.device, bias, top_k, num_expert_group, topk_group)


def check_linear_route_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                            num_expert_group: int, topk_group: int) -> None:
    """The absorbed form: x [tokens, hidden] and the router weight [experts, hidden] instead of logits."""
    if x.dim() != 2:
        raise ValueError(f"fused_route: the router input must be [tokens, hidden], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"fused_route: router_weight must be [experts, hidden = {x.shape[1]}], "
                         f"got shape {tuple(weight.shape)}")
    for name, t in (("the router input", x), ("router_weight", weight)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"fused_route: {name} must be fp32, bf16 or fp16, got {t.dtype}")
    if weight.device != x.device:
        raise ValueError(f"fused_route: router_weight is on {weight.device} but the router input is on {x.device}")
    _check_route_knobs(weight.shape[0], x.device, bias, top_k, num_expert_group, topk_group)


def _check_route_knobs(num_experts: int, device: torch.device, bias: torch.Tensor, top_k: int,
                       num_expert_group: int, topk_group: int) -> None:
    if bias.dim() != 1 or bias.shape[0] != num_experts:
        raise ValueError(f"fused_route: bias must be [experts] = [{num_experts}], got shape {tuple(bias.shape)}")
    if not bias.dtype.is_floating_point:
        raise ValueError(f"fused_route: bias must be a float tensor, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"fused_route: bias is on {bias.device} but the router's tensors are on {device}")
    if num_expert_group < 1 or num_experts % num_expert_group != 0:
        raise ValueError(f"fused_route: {num_experts} experts do not split into "
                         f"num_expert_group = {num_expert_group} equal groups")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"fused_route: topk_group = {topk_group} must be in 1..num_expert_group "
                         f"({num_expert_group})")
    group_size = num_experts // num_expert_group
    if num_expert_group > 1 and group_size < 2:
        raise ValueError(f"fused_route: group limiting ranks groups by their top-2 scores, so each group "
                         f"needs >= 2 experts; {num_experts} experts in {num_expert_group} groups have {group_size}")
    # Without this, the last picks would come from masked (-inf) experts: meaningless routing.
    eligible = topk_group * group_size
    if not 1 <= top_k <= eligible:
        raise ValueError(f"fused_route: top_k = {top_k} must be in 1..{eligible} "
                         f"(experts in the {topk_group} kept group(s) of {group_size})")


# --------------------------------------------------------------------------- CPU reference

def _nan_first(x: torch.Tensor) -> torch.Tensor:
    # NaN ranks above every number (torch.topk's convention); +inf makes sorts and argmax agree.
    return torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x)


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort keeps equal values in index order: the lowest index wins ties.
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                    scaling: float, num_expert_group: int = 1,
                    topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch routing. Returns (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    check_route_args(logits, bias, top_k, num_expert_group, topk_group)
    num_tokens, num_experts = logits.shape
    scores = logits.float().sigmoid()
    choice = _nan_first(scores + bias.float())
    if num_expert_group > 1:
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        group_scores = _nan_first(grouped.topk(2, dim=-1).values.sum(dim=-1))
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, _top_indices(group_scores, topk_group), True)
        expert_kept = kept.repeat_interleave(num_experts // num_expert_group, dim=1)
        choice = choice.masked_fill(~expert_kept, float("-inf"))
    ids = _top_indices(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return weights * scaling, ids


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused graph's router GEMM, op for op: mm(x.float(), W.float().t()), fp32 logits [T, E]."""
    return torch.mm(x.float(), weight.float().t())


def linear_route_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                           renormalize: bool, scaling: float, num_expert_group: int = 1,
                           topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed form's reference: the router GEMM, then `route_reference`."""
    check_linear_route_args(x, weight, bias, top_k, num_expert_group, topk_group)
    return route_reference(router_logits(x, weight), bias, top_k, renormalize, scaling, num_expert_group,
                           topk_group)


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _route_row(row_ptr, bias_ptr, out_w_ptr, out_id_ptr, scaling,
                   GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   GROUPS_PAD: tl.constexpr, GROUP_SIZE_PAD: tl.constexpr, TOP_K_PAD: tl.constexpr,
                   L2_ONLY: tl.constexpr, TAIL: tl.constexpr):
        # Routes one token whose E logits start at row_ptr. Its experts sit in a [group,
        # expert-in-group] register tile (one row when there is no group limiting); top-k is k rounds
        # of "take the best expert not yet taken" (TAIL_ROUNDS, TAIL_LEAN) or one bitonic top-k network
        # over the tile (TAIL_BITONIC); both yield the documented order. L2_ONLY: the row was written by
        # other programs of this launch, so read it past the (stale) L1. TAIL_ROUNDS reads the picks'
        # logits again from the row for their weights; the other tails gather them from the register tile
        # (one shared-memory step instead of a dependent global load).
        group = tl.arange(0, GROUPS_PAD)
        col = tl.arange(0, GROUP_SIZE_PAD)
        expert = group[:, None] * GROUP_SIZE + col[None, :]
        valid = (group[:, None] < NUM_GROUPS) & (col[None, :] < GROUP_SIZE)

        if L2_ONLY:
            z = tl.load(row_ptr + expert, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            z = tl.load(row_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        scores = tl.sigmoid(z)
        choice = scores + b
        choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first
        choice = tl.where(valid, choice, float("-inf"))

        if NUM_GROUPS > 1:
            # Group score: best + second best choice in the group (second excludes one copy of best).
            first = tl.max(choice, axis=1)
            first_col = tl.min(tl.where((choice == first[:, None]) & valid, col[None, :], GROUP_SIZE_PAD), axis=1)
            second = tl.max(tl.where((col[None, :] == first_col[:, None]) | ~valid, float("-inf"), choice), axis=1)
            group_score = first + second
            group_score = tl.where(group_score != group_score, float("inf"), group_score)
            group_valid = group < NUM_GROUPS
            kept = group < 0  # all False
            for _ in tl.static_range(TOPK_GROUP):
                open_ = group_valid & ~kept
                top = tl.max(tl.where(open_, group_score, float("-inf")), axis=0)
                pick = tl.min(tl.where(open_ & (group_score == top), group, GROUPS_PAD), axis=0)
                kept = kept | (group == pick)
            choice = tl.where(kept[:, None], choice, float("-inf"))

        # One max-reduction per pick: pack (choice, expert) into an int64 key ordered by "higher
        # choice, then lower expert index". The float's bits become an order-preserving int32
        # (negatives get their magnitude bits flipped; + 0.0 turns -0.0 into 0.0); the low 32 bits
        # hold the complemented index. Keys are unique, so a taken expert is knocked out by value.
        bits = (choice + 0.0).to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - expert).to(tl.int64)
        gone = tl.full(key.shape, -9223372036854775808, tl.int64)
        key = tl.where(valid, key, gone)
        slot = tl.arange(0, TOP_K_PAD)
        in_k = slot < TOP_K
        if TAIL == 2:  # TAIL_BITONIC: the TOP_K_PAD largest keys, descending (log-depth compare-exchange steps)
            top = tl.topk(tl.reshape(key, [GROUPS_PAD * GROUP_SIZE_PAD]), TOP_K_PAD)
            out_id = tl.where(in_k, 0x7FFFFFFF - (top & 0x7FFFFFFF), 0)
        else:
            out_id = tl.zeros([TOP_K_PAD], dtype=tl.int64)
            for i in tl.static_range(TOP_K):
                best = tl.max(tl.max(key, axis=1), axis=0)
                out_id = tl.where(slot == i, 0x7FFFFFFF - (best & 0x7FFFFFFF), out_id)
                key = tl.where(key == best, gone, key)

        # Weights are the unbiased scores of the picks (the same sigmoid of the same logits either way).
        if TAIL == 0:  # TAIL_ROUNDS: recompute them from the k logits
            if L2_ONLY:
                z_top = tl.load(row_ptr + out_id, mask=in_k, other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
                z_top = tl.load(row_ptr + out_id, mask=in_k, other=0.0).to(tl.float32)
            out_w = tl.where(in_k, tl.sigmoid(z_top), 0.0)
        else:  # gather them from the tile: expert id -> (group, column) -> flat tile position
            pos = (out_id // GROUP_SIZE) * GROUP_SIZE_PAD + out_id % GROUP_SIZE
            flat = tl.reshape(scores, [GROUPS_PAD * GROUP_SIZE_PAD])
            out_w = tl.where(in_k, tl.gather(flat, tl.where(in_k, pos, 0).to(tl.int32), 0), 0.0)
        if RENORMALIZE:
            out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
        out_w = out_w * scaling
        tl.store(out_w_ptr + slot, out_w, mask=in_k)
        tl.store(out_id_ptr + slot, out_id, mask=in_k)

    @triton.jit
    def _fused_route_kernel(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr,
        logits_row_stride, scaling,
        GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
        GROUPS_PAD: tl.constexpr, GROUP_SIZE_PAD: tl.constexpr, TOP_K_PAD: tl.constexpr,
    ):
        # One program routes one token.
        token = tl.program_id(0).to(tl.int64)
        _route_row(logits_ptr + token * logits_row_stride, bias_ptr, weights_ptr + token * TOP_K,
                   ids_ptr + token * TOP_K, scaling, GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, TOP_K, RENORMALIZE,
                   GROUPS_PAD, GROUP_SIZE_PAD, TOP_K_PAD, False, 0)

    @triton.jit
    def _linear_route_kernel(
        x_ptr, w_ptr, bias_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr,
        x_row_stride, w_row_stride, hidden, scaling,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, EXPERT_BLOCKS: tl.constexpr,
        GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
        GROUPS_PAD: tl.constexpr, GROUP_SIZE_PAD: tl.constexpr, TOP_K_PAD: tl.constexpr,
    ):
        # Program (expert block, token): the fp32 logits of BLOCK_E experts (x and W upcast as the
        # unfused graph's casts do; an fp32 multiply-add chain, no tensor cores, so no TF32), stored
        # to the workspace row. The token's last program to arrive (acq_rel counter, zeroed again by
        # it: CUDA-graph replays start from zero) routes the whole row.
        block = tl.program_id(0)
        token = tl.program_id(1).to(tl.int64)
        e = block * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < NUM_EXPERTS
        acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, hidden, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < hidden
            xv = tl.load(x_ptr + token * x_row_stride + d, mask=d_ok, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e[:, None].to(tl.int64) * w_row_stride + d[None, :],
                         mask=e_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            acc += wv * xv[None, :]
        _store_logits_and_route(tl.sum(acc, axis=1), e, e_ok, token, logits_ptr, arrivals_ptr, bias_ptr,
                                weights_ptr, ids_ptr, scaling, NUM_EXPERTS, EXPERT_BLOCKS, GROUP_SIZE, NUM_GROUPS,
                                TOPK_GROUP, TOP_K, RENORMALIZE, GROUPS_PAD, GROUP_SIZE_PAD, TOP_K_PAD, 0)

    @triton.jit
    def _store_logits_and_route(logits, e, e_ok, token, logits_ptr, arrivals_ptr, bias_ptr, weights_ptr, ids_ptr,
                                scaling, NUM_EXPERTS: tl.constexpr, EXPERT_BLOCKS: tl.constexpr,
                                GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                                TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
                                GROUP_SIZE_PAD: tl.constexpr, TOP_K_PAD: tl.constexpr, TAIL: tl.constexpr):
        # A program's block of a token's fp32 logits goes to the workspace row; the token's last program to
        # arrive (acq_rel counter, zeroed again by it: CUDA-graph replays start from zero) routes the row.
        # TAIL_ROUNDS zeroes the counter with an acq_rel exchange, which waits for its round trip before the
        # row is read; the other tails zero it relaxed (fire and forget): nothing else touches the counter in
        # this launch, and the next launch sees the zero because this grid has completed before it arrives.
        row = logits_ptr + token * NUM_EXPERTS
        tl.store(row + e, logits, mask=e_ok)
        tl.debug_barrier()  # every thread's logits are stored before this program arrives
        if EXPERT_BLOCKS == 1:
            _route_row(row, bias_ptr, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, scaling,
                       GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, TOP_K, RENORMALIZE, GROUPS_PAD, GROUP_SIZE_PAD,
                       TOP_K_PAD, True, TAIL)
        else:
            arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel")
            if arrived == EXPERT_BLOCKS - 1:
                if TAIL == 0:
                    tl.atomic_xchg(arrivals_ptr + token, 0)  # zero again for the next launch
                else:
                    tl.atomic_xchg(arrivals_ptr + token, 0, sem="relaxed")
                _route_row(row, bias_ptr, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, scaling,
                           GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, TOP_K, RENORMALIZE, GROUPS_PAD, GROUP_SIZE_PAD,
                           TOP_K_PAD, True, TAIL)


# The last-arriving program's routing tail (_route_row's TAIL), by name (P7's norm_route `tail` option): "rounds" is
# what fused_route's kernels always run.
TAIL_ROUNDS, TAIL_LEAN, TAIL_BITONIC = 0, 1, 2
ROUTE_TAILS = {"rounds": TAIL_ROUNDS,  # k argmax rounds; the picks' logits read again; acq_rel counter reset
               "lean": TAIL_LEAN,  # k argmax rounds; weights gathered from registers; relaxed counter reset
               "bitonic": TAIL_BITONIC}  # as lean, with a bitonic top-k network (tl.topk) instead of the rounds


def tail_code(tail: str) -> int:
    """_route_row's TAIL constexpr for a tail's name; ValueError naming the known ones."""
    if tail not in ROUTE_TAILS:
        raise ValueError(f"routing tail {tail!r}: expected one of {', '.join(ROUTE_TAILS)}")
    return ROUTE_TAILS[tail]


def kernel_supports(num_experts: int, top_k: int) -> bool:
    return triton is not None and num_experts <= KERNEL_MAX_EXPERTS and top_k <= KERNEL_MAX_TOP_K


def _route_constants(num_experts: int, top_k: int, renormalize: bool, num_expert_group: int,
                     topk_group: int) -> dict:
    """The routing tile's constexprs, shared by both kernels."""
    group_size = num_experts // num_expert_group
    return dict(GROUP_SIZE=group_size, NUM_GROUPS=num_expert_group, TOPK_GROUP=topk_group, TOP_K=top_k,
                RENORMALIZE=bool(renormalize), GROUPS_PAD=triton.next_power_of_2(num_expert_group),
                GROUP_SIZE_PAD=triton.next_power_of_2(group_size), TOP_K_PAD=triton.next_power_of_2(top_k))


def _kernel_outputs(num_tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Refuse what the kernels do not cover; allocate (weights fp32, ids int64) [T, k]."""
    if triton is None:
        raise RuntimeError("fused_route: triton is not installed")
    if not kernel_supports(num_experts, top_k):
        raise ValueError(f"fused_route kernel: supports up to {KERNEL_MAX_EXPERTS} experts and top_k "
                         f"{KERNEL_MAX_TOP_K}, got {num_experts} experts and top_k {top_k}")
    return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int64, device=device))


def route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                 scaling: float, num_expert_group: int = 1, topk_group: int = 1,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    check_route_args(logits, bias, top_k, num_expert_group, topk_group)
    num_tokens, num_experts = logits.shape
    weights, ids = _kernel_outputs(num_tokens, num_experts, top_k, logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = bias.contiguous()
    if num_tokens == 0:
        return weights, ids
    const = _route_constants(num_experts, top_k, renormalize, num_expert_group, topk_group)
    tile = const["GROUPS_PAD"] * const["GROUP_SIZE_PAD"]
    if num_warps is None:
        # Measured on an H200 at E=896, k=16: 4 warps is fastest for decode-sized T (5.4 us at
        # T=1..64, CUDA-graph replay), 2 warps for long prefill chunks (46 us vs 55 us at T=4096).
        num_warps = (4 if num_tokens < 1024 else 2) if tile >= 512 else (2 if tile >= 128 else 1)
    _fused_route_kernel[(num_tokens,)](
        logits, bias, weights, ids, logits.stride(0), float(scaling), **const, num_warps=num_warps)
    return weights, ids


# Programs per token of the absorbed kernel: enough of them in all to keep the GPU's ~132 SMs reading W
# at batch 1 (one W block each), fewer but wider blocks as the batch grows (each token re-reads W, from L2).
LINEAR_ROUTE_TARGET_PROGRAMS = 128
LINEAR_ROUTE_MAX_BLOCK_E = 16
LINEAR_ROUTE_MAX_TILE = 8192  # fp32 elements of the [BLOCK_E, BLOCK_D] accumulator
ARRIVALS_OWNER = "fused_route"  # the absorbed kernel's own arrival counters (arrivals.py)


def default_linear_route_blocks(num_tokens: int, num_experts: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_E, BLOCK_D, num_warps) of the absorbed kernel, from static shapes only (a CUDA graph replays
    one grid per batch size)."""
    block_e = 1
    while (block_e * 2 <= LINEAR_ROUTE_MAX_BLOCK_E and block_e * 2 <= num_experts
           and num_tokens * triton.cdiv(num_experts, block_e * 2) >= LINEAR_ROUTE_TARGET_PROGRAMS):
        block_e *= 2
    block_d = max(16, min(triton.next_power_of_2(hidden), LINEAR_ROUTE_MAX_TILE // block_e))
    num_warps = 8 if block_e * block_d >= 4096 else 4
    return block_e, block_d, num_warps


def linear_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                        renormalize: bool, scaling: float, num_expert_group: int = 1, topk_group: int = 1,
                        block_e: int | None = None, block_d: int | None = None,
                        num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router GEMM and the routing in one launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).
    block_e / block_d / num_warps override `default_linear_route_blocks` (benchmarks)."""
    check_linear_route_args(x, weight, bias, top_k, num_expert_group, topk_group)
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    weights, ids = _kernel_outputs(num_tokens, num_experts, top_k, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    bias = bias.contiguous()
    if num_tokens == 0:
        return weights, ids
    be, bd, nw = default_linear_route_blocks(num_tokens, num_experts, hidden)
    be, bd, nw = block_e or be, block_d or bd, num_warps or nw
    if be & (be - 1) or bd & (bd - 1):
        raise ValueError(f"fused_route kernel: block_e ({be}) and block_d ({bd}) must be powers of two")
    expert_blocks = triton.cdiv(num_experts, be)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)  # workspace
    arrivals = arrival_counters(x.device, num_tokens, ARRIVALS_OWNER) if expert_blocks > 1 else logits  # (unused at 1)
    _linear_route_kernel[(expert_blocks, num_tokens)](
        x, weight, bias, logits, arrivals, weights, ids, x.stride(0), weight.stride(0), hidden, float(scaling),
        NUM_EXPERTS=num_experts, BLOCK_E=be, BLOCK_D=bd, EXPERT_BLOCKS=expert_blocks,
        **_route_constants(num_experts, top_k, renormalize, num_expert_group, topk_group), num_warps=nw)
    return weights, ids


# --------------------------------------------------------------------------- the k3 op

@torch.library.custom_op("k3::fused_route", mutates_args=())
def fused_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                scaling: float, num_expert_group: int = 1, topk_group: int = 1,
                router_weight: torch.Tensor | None = None,
                absorb_max_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in one node: (topk_weights [T, k] fp32, topk_ids [T, k] int64). See module doc.
    With router_weight, `logits` is the router's input x [T, D] and the node computes the logits too."""
    if router_weight is not None:
        return linear_route_reference(logits, router_weight, bias, top_k, renormalize, scaling, num_expert_group,
                                      topk_group)
    return route_reference(logits, bias, top_k, renormalize, scaling, num_expert_group, topk_group)


@fused_route.register_kernel("cuda")
def _fused_route_cuda(logits, bias, top_k, renormalize, scaling, num_expert_group=1, topk_group=1,
                      router_weight=None, absorb_max_tokens=0):
    args = (top_k, renormalize, scaling, num_expert_group, topk_group)
    with torch.cuda.device(logits.device):  # Triton launches on the current device
        if router_weight is not None:
            check_linear_route_args(logits, router_weight, bias, top_k, num_expert_group, topk_group)
            if logits.shape[0] <= absorb_max_tokens and kernel_supports(router_weight.shape[0], top_k):
                return linear_route_triton(logits, router_weight, bias, *args)
            logits = router_logits(logits, router_weight)  # cuBLAS, then the routing kernel
        if kernel_supports(logits.shape[-1], top_k):
            return route_triton(logits, bias, *args)
        return route_reference(logits, bias, *args)


@fused_route.register_fake
def _fused_route_fake(logits, bias, top_k, renormalize, scaling, num_expert_group=1, topk_group=1,
                      router_weight=None, absorb_max_tokens=0):
    if router_weight is not None:
        check_linear_route_args(logits, router_weight, bias, top_k, num_expert_group, topk_group)
    else:
        check_route_args(logits, bias, top_k, num_expert_group, topk_group)
    num_tokens = logits.shape[0]
    return (logits.new_empty(num_tokens, top_k, dtype=torch.float32),
            logits.new_empty(num_tokens, top_k, dtype=torch.int64))
