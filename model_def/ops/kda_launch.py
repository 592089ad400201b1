"""Launch layouts of the KDA decode kernel (P5), shared with the kernels that must reproduce its bits.

P5's fused decode kernel (passes/kernels/kda_decode.py) walks each head's [K, V] fp32 state in [K, BV]
column blocks, its V columns split over `v_split` programs at small batch; a block's shape and the warps
holding it fix the order of its K reductions (S^T k, S^T q), so the ReplaySSM fold
(runtime/spec/fold_kernel.py) and the verify-inputs kernel (passes/kernels/kda_verify_inputs.py) must
use the blocks P5 used for a decode step of the same batch to stay bit-identical to it. The rule lives
here, where the passes and the runtime may both import it, so there is one copy.

A layout is named, not free-form: an engine records the name (P5's and P16's `launch` option; the fold
gets it from the spec decoder), and every name is a rule over static shapes only (a CUDA graph replays one
grid per batch size).

- "s8": session 4's rule (tools/bench_kda_decode.py): while batch x heads <= 128 each head's V is split
  into up to 4 parts of >= 16 columns; blocks of <= 32 columns; 4 warps for a block of >= 64 x 32, else 1.
  48B batch 1 (split 4, 32 columns, 4 warps): 8.61 us alone (traces/h200_s8/kda8.md).

"s8" is the only layout. kda9 added "wide" (at most 2 parts, blocks of <= 64 columns, 8 warps for a block
of >= 128 x 64; kda8's fastest batch-1 launch alone, 8.36 us) and it was dropped after session 9's H200 run
(device call 1): the whole 48B engine was not faster with it (bench ladder, batch 1: 2.329 ms per step vs
2.319 ms with s8; traces/h200_s9/call1/ladder_kimi-linear-48b_bf16.md, row v-kdawide), and the ReplaySSM
fold was no longer bit-identical to P5's decode under it (tests/runtime/spec/test_fold_gpu.py failed for
every "wide" case and passed for every "s8" one).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_ROWS_TO_SPLIT = 128  # above this many (request, head) rows the GPU is full with one program per row
MIN_V_PER_PROGRAM = 16


@dataclass(frozen=True)
class _Rule:
    max_v_split: int
    max_block_v: int  # state columns per block


LAYOUTS = {
    "s8": _Rule(max_v_split=4, max_block_v=32),
}
DEFAULT_LAYOUT = "s8"


@dataclass(frozen=True)
class KDALaunch:
    v_split: int    # programs per (request, head) along V
    block_v: int    # state columns per block (a power of 2)
    num_warps: int


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KDA decode launch layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return layout


def v_split_for(layout: str, batch: int, heads: int, value_dim: int) -> int:
    """Parts each head's V columns are split into for a decode step of `batch` requests."""
    rule = LAYOUTS[check_layout(layout)]
    if batch * heads > MAX_ROWS_TO_SPLIT:
        return 1
    split = 1
    while (split < rule.max_v_split and value_dim % (2 * split) == 0
           and value_dim // (2 * split) >= MIN_V_PER_PROGRAM):
        split *= 2
    return split


def block_v_for(layout: str, v_split: int, value_dim: int) -> int:
    """State columns per block of a program owning V / v_split columns."""
    rule = LAYOUTS[check_layout(layout)]
    return min(_next_pow2(value_dim // v_split), rule.max_block_v)


def warps_for(layout: str, head_k: int, block_v: int) -> int:
    """Warps of a program walking [head_k, block_v] state blocks."""
    check_layout(layout)  # every layout so far: 4 warps from a 64 x 32 block
    return 4 if _next_pow2(head_k) * block_v >= 64 * 32 else 1


def kda_launch(layout: str, batch: int, heads: int, head_k: int, value_dim: int) -> KDALaunch:
    """P5's launch for a decode step of `batch` requests under `layout`."""
    split = v_split_for(layout, batch, heads, value_dim)
    block_v = block_v_for(layout, split, value_dim)
    return KDALaunch(split, block_v, warps_for(layout, head_k, block_v))
