"""Which launch each of the fused MoE decode's kernels (kernels/moe_decode.py) gets, per shape: the tile rules,
the tables of measured winners that override them, the candidates the sweeps try, and the checks of a launch given
by hand (P6's down_split / up_launch options, benches).

Why a file of its own: these are tuning data and small pure functions of shapes. They change whenever a device sweep
(tools/bench_moe*.py) finds a better tile, while the kernels do not, and a bench or a pass can read them without the
kernels' code.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import l2_prefetch

try:
    import triton
except ImportError:  # CPU-only install without Triton: the rules need triton.cdiv / next_power_of_2
    triton = None

# Tile rule for the GEMV kernels. A GEMV at batch 1-64 is bound by the bytes each SM keeps in flight, and
# none of these loops is software-pipelined (their loads feed no dot), so: many short programs (>= 4 per
# SM of an H200's 132: a program takes ~150-170 registers a thread, so 2-3 fit on an SM, and a grid just
# above that count would run a long second round with little in flight), and per iteration one tile of
# TILE_ELEMS weights per program (16 KiB of bf16; its fp32 products, summed in place, are 64 registers a
# thread), issued together because nothing in the loop depends on a load of the same iteration. A program's
# tile is rows_per_step x BLOCK_K: kernel A reads the gate and up rows (2 BLOCK_N), kernel B (bf16) all k
# experts' rows at once (k BLOCK_N). TUNED overrides the rule for a key it lists (from bench_moe_kernels.py).
TARGET_PROGRAMS = 528
TILE_ELEMS = 8192
MIN_BLOCK_K = 64
# H200 tile sweep of tools/bench_moe_kernels.py (issue 9, 48B layer: E=256, top-8, D=2304, I=1024), kernel µs
# rule -> best: bf16 down batch 1 [4,256,4] 24.9 -> [8,128,4] 24.3; MXFP4 down batch 1 [4,1024,4] 16.4 ->
# [4,512,4] 15.2; MXFP4 up batch 1 [8,512,4] 28.3 -> [16,256,4] 26.2. Key: gemv_config's arguments.
TUNED: dict[tuple, tuple[int, int, int]] = {
    ("down", 1, 2304, 1024, False): (8, 128, 4),
    ("down", 1, 2304, 1024, True): (4, 512, 4),
    ("up", 8, 1024, 2304, True): (16, 256, 4),
}


class SplitConfig(NamedTuple):
    """Launch of kernel B' (the split down-projection): the tile, and how each slot's K is cut."""
    block_n: int  # output columns per program
    block_k: int  # K tile per iteration (the shared slot's: shared_block_k, unless the caller forces block_k)
    num_warps: int
    k_split: int = 1  # K chunks per slot: programs = tokens x column blocks x slots x k_split
    prefetch: bool = False  # dense weights: the next K tile's loads issued before the current tile's products


# Kernel B''s launch per shape, keyed like gemv_config's "split" call: (tokens x slots, output rows, K = I, MXFP4);
# a key not listed takes the tile rule with k_split 1, no prefetch. tools/bench_moe9.py sweeps the candidates
# (SPLIT_CANDIDATES) at the 48B shape and batch 1-8; its winner per batch goes here.
#   48B bf16 batch 1 (8 experts + the shared one = 9 slots): rule [32,256,4] 15.6 -> [64,128,4] 14.5 us
#   (traces/h200_s7/moe7.md; at batch 8 and for MXFP4 the rule's tile was the best swept); 14.2 us in
#   traces/h200_s8/moe8_fixed.md (~70% of the copy bandwidth for its 42.5 MB).
SPLIT_TUNED: dict[tuple[int, int, int, bool], SplitConfig] = {
    (9, 2304, 1024, False): SplitConfig(64, 128, 4),
    # session 9 (tools/bench_moe9.py, call 1, MoE op µs with PDL): batch 2 73.3 -> 64.6 and batch 4 122.1 -> 113.9 with
    # two K chunks per slot; at batch 1 and 8 today's launch stayed the fastest (batch 1's prefetch arm: no gain in
    # the whole 48B step, bench ladder variant 2.325 vs 2.319 ms)
    (18, 2304, 1024, False): SplitConfig(64, 128, 4, 2, False),
    (36, 2304, 1024, False): SplitConfig(64, 128, 4, 2, False),
    # k3-mini-6b batch 2 (session 10, tools/bench_moe10mini.py, traces/h200_s10/call4/mini10.md: op 29.25 -> 26.36 us
    # with the ROWS_TUNED / LATENT_TUNED entries of the same batch)
    (16, 1024, 512, False): SplitConfig(64, 128, 4, 1, True),
}
# What bench_moe9.py tries besides today's choice (dense weights, 48B shape): more programs (smaller BLOCK_N or K
# chunks: 324 programs of 128 KB on 132 SMs leave a third of the SMs a third program's worth of tail) and more
# bytes in flight per program (prefetch, 8 warps with a wider tile).
SPLIT_CANDIDATES: tuple[SplitConfig, ...] = (
    SplitConfig(64, 128, 4), SplitConfig(64, 128, 4, 1, True), SplitConfig(32, 256, 4, 1, True),
    SplitConfig(64, 128, 4, 2), SplitConfig(64, 128, 4, 2, True), SplitConfig(32, 128, 4, 2, True),
    SplitConfig(64, 128, 4, 4, True), SplitConfig(128, 64, 4, 4, True), SplitConfig(64, 256, 8, 2, True),
    SplitConfig(32, 256, 4, 2, True),
)

# The launches of k3-mini-6b's latent MoE (E=96, top-8, I=512 on the 1024-wide latent, up-projection to 2048, two
# shared experts' width Is=1024 with its GLU in kernel C) were never swept: every rule above was tuned at the 48B
# shape. tools/bench_moe10mini.py times the op at that shape (batch 1, 8, 2, 4), today's launches vs the candidates
# below, one kernel varied at a time, then the best combination; it prints the table entries for its winners.
# Kernel B' candidates there (key (tokens x 8, 1024, 512, False): today's rule gives (8, 512, 4) at batch 1, 1024
# programs of 8 KB each, and (64, 128, 4) at batch 8): wider row blocks, K chunks, prefetch, fewer/more warps.
LATENT_SPLIT_CANDIDATES: tuple[SplitConfig, ...] = (
    SplitConfig(16, 512, 4), SplitConfig(32, 512, 8), SplitConfig(32, 256, 4, 1, True), SplitConfig(16, 256, 4, 2, True),
    SplitConfig(8, 256, 4, 2, True), SplitConfig(4, 512, 4), SplitConfig(64, 128, 4, 1, True),
    SplitConfig(32, 128, 4, 2, True),
)

# Kernel A's "rows" launch (and kernel B's, design "rows") per shape: (BLOCK_N, BLOCK_K, num_warps), keyed like
# rows_config's call: (kernel "up" / "down", programs per row block (A: tokens x top_k), rows (A: I; B: Do), K (A: D;
# B: I)); a key not listed takes the rule.
# k3-mini-6b (session 10, tools/bench_moe10mini.py, traces/h200_s10/call4/mini10.md, MoE op us with PDL, today ->
# with the batch's entries here, in SPLIT_TUNED and in LATENT_TUNED): batch 2 29.25 -> 26.36, 4 47.15 -> 41.45,
# 8 64.1 -> 60.91; batch 1's best (19.84 -> 19.57) is within noise: not adopted
# Kimi-Linear-48B batch 1 (session 11, tools/bench_moe11.py, traces/h200_s11/call2/moe11.md, op us with PDL): the
# rule's (16, 256, 4) -> 8 warps, 41.76 -> 36.75 us (kernel A alone; flag_deps added nothing on top: 36.91); whole
# 48B step 2.236 -> 2.206 ms (traces/h200_s11/call3, same run)
ROWS_TUNED: dict[tuple[str, int, int, int], tuple[int, int, int]] = {
    ("up", 8, 1024, 2304): (16, 256, 8),
    # batch 8: (16, 256, 4) instead of the rule's (64, 128, 4): whole 48B step 7.133 -> 7.002 ms (traces/h200_s11/call3,
    # variant v-old, same run)
    ("up", 64, 1024, 2304): (16, 256, 4),
    ("up", 16, 512, 1024): (16, 512, 8),
    ("up", 32, 512, 1024): (64, 256, 8),
    ("up", 64, 512, 1024): (32, 128, 4),
}
# What bench_moe10mini.py tries for kernel A (rows) at k3-mini: today's rule gives (8, 256, 4) at batch 1 (512 programs
# of 32 KB: 16 rows x 1024) and (64, 128, 4) at batch 8.
ROWS_CANDIDATES: tuple[tuple[int, int, int], ...] = (
    (4, 256, 4), (4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (8, 256, 2), (32, 128, 4),
    (64, 256, 8),
)

# What tools/bench_moe11.py tries for kernel A (rows, shared slot in A as P6 emits it) at the Kimi-Linear-48B shape
# (E=256, top-8, I=1024, D=2304, one shared expert): today's rule gives (16, 256, 4) at batch 1, 9 slots x 64 column
# blocks = 576 programs of 147 KB on 132 SMs (4.4 a SM), and (64, 128, 4) at batch 8 (1152 programs). Fewer, larger
# programs (32 or 64 rows: 288 / 144, ~2.2 / ~1.1 a SM), more and smaller (8 rows: 1152), other K tiles (D = 9 x 256)
# and warps.
FULL_ROWS_CANDIDATES: tuple[tuple[int, int, int], ...] = (
    (8, 256, 4), (16, 128, 4), (16, 256, 2), (16, 256, 8), (16, 512, 8), (32, 128, 4), (32, 256, 4), (32, 256, 8),
    (64, 128, 4), (64, 128, 8), (64, 256, 8), (128, 128, 8),
)
# B' launches tools/bench_moe11.py tries with flag_deps on (48B): K cut in chunks, so a B' program waits for a part of
# its h row only (with one chunk it waits for the whole row, i.e. for all of A's column blocks of that expert)
FLAG_SPLIT_CANDIDATES: tuple[SplitConfig, ...] = (
    SplitConfig(64, 128, 4, 2), SplitConfig(64, 128, 4, 2, True), SplitConfig(64, 128, 4, 4, True),
    SplitConfig(32, 128, 4, 2, True),
)


class LatentConfig(NamedTuple):
    """Launch of kernel C (`_latent_out_kernel`): output columns per program, the up-projection's K tile, the shared
    expert's K tile, warps."""
    block_n: int
    block_k: int
    block_ks: int
    num_warps: int


# Kernel C's launch per shape, keyed (tokens, output width D, latent width, shared width Is); a key not listed takes
# the tile rule (gemv_config "latent", K tiles from shared_block_k). Nothing measured yet: empty.
LATENT_TUNED: dict[tuple[int, int, int, int], LatentConfig] = {  # k3-mini-6b batch 2, 4, 8: see ROWS_TUNED
    (2, 2048, 1024, 1024): LatentConfig(block_n=16, block_k=512, block_ks=512, num_warps=8),
    (4, 2048, 1024, 1024): LatentConfig(block_n=32, block_k=256, block_ks=256, num_warps=4),
    (8, 2048, 1024, 1024): LatentConfig(block_n=32, block_k=256, block_ks=256, num_warps=4),
}
# What bench_moe10mini.py tries for kernel C at k3-mini: today's rule gives (4, 1024, 1024, 4) at batch 1 (512
# programs of 16 KB: 4 rows of W_up and of the shared W2) and (16, 512, 512, 4) at batch 8.
LATENT_CANDIDATES: tuple[LatentConfig, ...] = (
    LatentConfig(8, 1024, 1024, 4), LatentConfig(8, 512, 512, 4), LatentConfig(16, 512, 512, 4),
    LatentConfig(16, 512, 512, 8), LatentConfig(2, 1024, 1024, 4), LatentConfig(4, 512, 512, 4),
    LatentConfig(4, 1024, 1024, 8), LatentConfig(32, 256, 256, 4),
)


def latent_config(tokens: int, out_width: int, latent_width: int, shared_width: int, quantized: bool = False,
                  block_n: int | None = None) -> LatentConfig:
    """Kernel C's launch: LATENT_TUNED's entry for (tokens, out_width, latent_width, shared_width), else the tile rule
    (gemv_config "latent"; quantized only selects its TUNED key). block_n: the caller's override (tests, tile sweeps),
    which skips the table and sizes the K tiles for that block."""
    tuned = LATENT_TUNED.get((tokens, out_width, latent_width, shared_width)) if block_n is None else None
    if tuned is not None:
        return check_latent_config(tuned)
    bn, _, warps = gemv_config("latent", tokens, out_width, latent_width, quantized)
    bn = block_n or bn
    return LatentConfig(bn, shared_block_k(bn, latent_width), shared_block_k(bn, max(shared_width, 1)), warps)


def check_latent_config(launch: LatentConfig) -> LatentConfig:
    """A LatentConfig (or a tuple of its fields) with every field a power of two in range, else ValueError."""
    launch = LatentConfig(*launch)
    for name, least in (("block_n", 1), ("block_k", 32), ("block_ks", 32), ("num_warps", 1)):
        check_pow2(f"latent {name}", getattr(launch, name), least)
    return launch

# Which design runs each kernel: "tiles" (the kernels above with a [rows, K] tile summed in place; MXFP4 and,
# at small batches, the bf16 down-projection) or "rows" (_expert_*_rows_kernel, a per-iteration reduction;
# dense weights only). From static shapes only (CUDA-graph safe, no runtime autotuning). Kernel µs measured
# on an H200 by tools/bench_moe_kernels.py (rows / tiles, bf16):
#   up,   48B:     batch 1 23.8 / 34.9 (best swept tile 28.9), batch 8 127 / 281 (152), batch 64 744 / 1816
#   up,   k3-mini: batch 1 5.8 / 8.3, batch 8 26 / 59                         -> rows at every batch
#   down, 48B:     batch 1 32.2 / 24.9 (24.3 with the TUNED tile), batch 8 84 / 137 (109), batch 64 524 / 750
#   down, k3-mini: batch 1 9.0 / 5.5, batch 8 22.8 / 20.9, batch 64 75.7 / 126.9
#   (session 4; for the down-projection superseded by "split", table below)   -> tiles below batch 8, rows from 8
# (k3-mini batch 8 loses ~2 µs to the one-threshold rule.) MXFP4: tiles won every measured case (48B batch 1
# up 28.3 vs 30.0, down 16.0 vs 23.1; batch 8 up 164 vs 198, down 101 vs 143).
DESIGNS = ("rows", "tiles")  # kernel A's designs (and kernel B's, which also has "split")
DOWN_DESIGNS = DESIGNS + ("split",)  # "split": _expert_down_split_kernel, dense and MXFP4
# The static per-batch choice (CUDA-graph safe): {from batch: (up design, down design)}, a batch taking the entry
# of the largest key <= it. Session 7's H200 run of tools/bench_moe7.py (traces/h200_s7/moe7.md; down kernel µs,
# tiles / rows / split, CUDA-graph replays over 4 cycled routings):
#   48B bf16:       batch 1 24.6 / 32.8 / 15.7 (14.5 TUNED), 2: 47.3 / 31.0 / 24.8, 4: 91.6 / 55.8 / 44.7, 8: 137.5 / 84.4 / 80.7
#   k3-mini bf16:   batch 1 6.3 / 12.9 / 6.8, 2: 11.6 / 13.6 / 10.7, 4: 17.3 / 21.0 / 12.8, 8: 21.6 / 23.7 / 20.3
#   48B MXFP4:      batch 1 17.4 / - / 16.2, 2: 39.1 / - / 27.3, 4: 62.6 / - / 45.8, 8: 101.9 / - / 87.0
#   k3-mini MXFP4:  batch 1 7.3 / - / 5.6, 2: 9.5 / - / 9.5, 4: 12.0 / - / 13.9, 8: 21.5 / - / 20.2
# -> split everywhere (k3-mini loses 0.5 us at bf16 batch 1 and 2 us at MXFP4 batch 4 to the one-table rule; the
# 48B layer gains 9 us at batch 1). Batches from 16 up to the grouped-GEMM crossover were not measured.
DENSE_DESIGNS: dict[int, tuple[str, str]] = {1: ("rows", "split")}
MXFP4_DESIGNS: dict[int, tuple[str, str]] = {1: ("tiles", "split")}


def kernel_designs(tokens: int, quantized: bool) -> tuple[str, str]:
    """(up design, down design) for a batch of `tokens` (DENSE_DESIGNS / MXFP4_DESIGNS; see the table above)."""
    table = MXFP4_DESIGNS if quantized else DENSE_DESIGNS
    return table[max((b for b in table if b <= max(tokens, 1)), default=min(table))]


def rows_config(programs_per_block: int, rows: int, pairs: int, kernel: str | None = None,
                k: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a "rows" kernel: ROWS_TUNED's entry for (kernel "up" / "down",
    programs_per_block, rows, K = k), else the pre-rework rule: the widest BLOCK_N in 64..8 that still gives
    >= 264 programs (2 per H200 SM); BLOCK_K 256 for <= 16 (token, expert) pairs, else 128 (its H200 sweep at
    the 48B shape)."""
    tuned = ROWS_TUNED.get((kernel, programs_per_block, rows, k))
    if tuned is not None:
        for name, value, least in zip(("rows block_n", "rows block_k", "rows num_warps"), tuned, (1, 32, 1)):
            check_pow2(name, value, least)
        return tuple(tuned)
    block_n = next((bn for bn in (64, 32, 16) if programs_per_block * triton.cdiv(rows, bn) >= 264), 8)
    return block_n, 256 if pairs <= 16 else 128, 4


def gemv_config(kernel: str, programs_per_block: int, rows: int, k: int, quantized: bool,
                top_k: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for kernel "up" / "down" / "latent": `rows` output rows split into
    blocks of BLOCK_N, each block run by `programs_per_block` programs (tokens, or token x expert pairs),
    over a K that is `k` long (per expert for "down", whose bf16 tile spans all top_k experts). "split" (kernel
    B's split design): programs_per_block counts tokens x slots, each program one expert's rows."""
    tuned = TUNED.get((kernel, programs_per_block, rows, k, quantized))
    if tuned is not None:
        return tuned
    per_row = {"up": 2, "down": 1 if quantized else triton.next_power_of_2(top_k)}.get(kernel, 1)  # split: 1
    fits = [bn for bn in (64, 32, 16, 8, 4) if bn * per_row * MIN_BLOCK_K <= TILE_ELEMS] or [4]
    block_n = next((bn for bn in fits if programs_per_block * triton.cdiv(rows, bn) >= TARGET_PROGRAMS), fits[-1])
    block_k = max(32, min(TILE_ELEMS // (block_n * per_row), triton.next_power_of_2(k)))
    # a tile that does not divide K loads a masked tail on every row: allow up to 1/8 of the iterations'
    # lanes masked (2304: 512 -> 5 tiles, 10% masked; 1024 -> 3 tiles, 25%: too many)
    while block_k > MIN_BLOCK_K and (-k % block_k) * 8 > triton.cdiv(k, block_k) * block_k:
        block_k //= 2
    return block_n, block_k, 4


def split_config(programs_per_block: int, rows: int, k: int, quantized: bool) -> SplitConfig:
    """Kernel B''s launch for tokens x slots = programs_per_block, `rows` output rows, K = k: SPLIT_TUNED's entry,
    else the tile rule (gemv_config "split") with one K chunk and no prefetch."""
    tuned = SPLIT_TUNED.get((programs_per_block, rows, k, quantized))
    return tuned if tuned is not None else SplitConfig(*gemv_config("split", programs_per_block, rows, k, quantized))


def check_split_config(split: SplitConfig) -> SplitConfig:
    """A SplitConfig (or a tuple of its fields) with every field in range, else ValueError naming it."""
    split = SplitConfig(*split)
    check_pow2("split block_n", split.block_n, 1)
    check_pow2("split block_k", split.block_k, 32)
    check_pow2("split num_warps", split.num_warps, 1)
    if split.k_split < 1:
        raise ValueError(f"fused_moe_decode: split k_split must be >= 1, got {split.k_split}")
    return split


def split_from_list(values) -> SplitConfig:
    """A SplitConfig from its fields as ints (the op's down_split argument: prefetch 0/1), checked."""
    values = [int(v) for v in values]
    if not 3 <= len(values) <= 5 or (len(values) == 5 and values[4] not in (0, 1)):
        raise ValueError(f"fused_moe_decode: down_split must be [block_n, block_k, num_warps(, k_split(, prefetch "
                         f"0/1))], got {values}")
    return check_split_config(SplitConfig(*values[:4], *[bool(v) for v in values[4:]]))


def check_up_launch(values) -> tuple[int, int, int]:
    """Kernel A's launch (BLOCK_N, BLOCK_K, num_warps) as ints (the op's up_launch argument), each a power of two in
    range, else ValueError naming it."""
    values = tuple(int(v) for v in values)
    if len(values) != 3:
        raise ValueError(f"fused_moe_decode: up_launch must be [block_n, block_k, num_warps], got {list(values)}")
    for name, value, least in zip(("up block_n", "up block_k", "up num_warps"), values, (1, 32, 1)):
        check_pow2(name, value, least)
    return values


def flag_chunks(inter: int, shared_width_a: int, out_width: int, launch_b: SplitConfig,
                block_ks: int) -> tuple[int, int]:
    """flag_deps: (routed chunk, shared chunk): B''s K chunk widths over h (I) and over A's shared slot's hs (Is; 1
    without it), as its `_chunk` cuts them. ValueError if a counter's fields cannot hold a chunk's columns (16 bits)
    or its readers (15 bits: B''s column groups per token)."""
    def size(width, tile):
        return triton.cdiv(triton.cdiv(width, launch_b.k_split), tile) * tile
    chunk = size(inter, launch_b.block_k)
    chunk_s = size(shared_width_a, block_ks) if shared_width_a else 1
    readers = triton.cdiv(out_width, launch_b.block_n)
    if max(chunk, chunk_s) >= 1 << 16 or readers >= 1 << 15:
        raise ValueError(f"fused_moe_decode: flag_deps counts up to 65535 columns per K chunk and 32767 readers, got "
                         f"chunks {chunk} / {chunk_s} and {readers} readers")
    return chunk, chunk_s


def shared_block_k(block_n: int, width: int) -> int:
    """K tile of the shared expert's GEMV (and kernel C's) for a program of block_n rows: TILE_ELEMS a tile."""
    return max(32, min(TILE_ELEMS // block_n, triton.next_power_of_2(width)))


L2_PREFETCH_MAX_TOKENS = 1  # the shared-slot L2 prefetch options apply up to this many tokens (see fused_moe_triton)


def shared_l2_launch(asked: bool, pdl: bool, shared_w13: torch.Tensor, width: int) -> tuple[bool, bool]:
    """(shared slot first in kernel A's launch order, its L2 prefetch) for the op's shared_l2_prefetch option: the
    order whenever asked (the interpreter runs it, so CPU tests cover it); the prefetch only with PDL (the inline PTX
    has no interpreter, and without PDL there is no kernel before A to overlap) and 16-byte-aligned rows."""
    if not asked:
        return False, False
    return True, pdl and l2_prefetch.region_ok(shared_w13, width * shared_w13.element_size())


def check_pow2(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"fused_moe_decode: {name} must be a power of two >= {least}, got {value}")
