"""A chain of decode GEMVs in one launch, y_s = y_{s-1} @ W_s^T (s = 1..S), its tiles ordered by tickets.

Why it exists: an experiment for issue 9's next step. k3-mini-6b's batch-1 step is ~290 launches, and their
boundaries (the launch, the ramp, the drain: ~2-4 us each) are most of what separates it from its roofline
(passes/README.md, "k3-mini-6b batch-1 budget"), so 70% there needs a persistent, megakernel-style decode. Before
anything that large is built, this kernel measures what one kind of boundary, GEMV -> GEMV, costs against a
dependency inside one launch: tools/bench_gemv_chain.py times S separate `k3.gemv` launches (rows design, PDL with
early release: the engine's form) against this one launch on the same weights. It is not a pass.

How one launch runs dependent stages without a grid-wide barrier: each program first takes a ticket (an atomic
counter), and tickets, not program ids, name the work, in stage order: tickets [0, T_1) are stage 1's column tiles,
[T_1, T_1 + T_2) stage 2's, and so on. A stage-s tile loads its first weight tile, waits until all T_{s-1} tiles of
stage s-1 have published (a done counter per stage: release after the tile's stores, acquire in the wait), then
reads y_{s-1} (through L2: `.cg`) and streams the rest of its weights. A program waits only on lower tickets, which
belong to programs that have already started, so every wait ends whatever order the GPU starts programs in (fixed
program ids would let a waiting program hold the SM its producer needs). The counters count up across launches
(launch e waits for (e + 1) x the tile counts), so a CUDA graph replays the launch with no memset and no reset. A
waiting tile reads the counter with plain volatile loads (optionally sleeping `backoff_ns` between them) and takes one
acquire once it is satisfied. Under TRITON_INTERPRET=1 programs run one after another in ticket order, so no wait
ever spins.

The persistent form (`persistent=True`, session 20, not yet run on a GPU) asks whether what a tile costs beyond its
bytes is the program started for it and its ticket atomic (thousands of programs on one counter address) rather
than the wait: one program per SM takes tiles p, p + P, ... in ticket order, so there is no ticket counter, and its
launch's epoch is the last stage's count that the previous launch left. Static tiles are safe only while every
program is resident, which is why there is one program per SM. A program's own earlier tiles are done before its
later ones, and the lowest unfinished tile never waits. P is at most every stage's tile count, so each program owns a
tile of the last stage, and no launch finishes before each program has read its epoch.

Measured (traces/h200_s19/call1, H100, M = 1): the first form of this kernel, which polled with atomics and reset its
counters through a finish counter, was 2.6-2.9x slower than separate launches with PDL; this form has not run yet.

Arithmetic: each tile is the rows design of kernels/gemv.py with one K split (a [BLOCK_N, BLOCK_K] weight tile times
every x row in registers, fp32 products summed in place, reduced once, rounded to the dtype), so each stage equals
`torch.mm(y_{s-1}, W_s.t())` to bf16 rounding (tests/passes/kernels/test_gemv_chain.py).

Layout: the weights of all stages in one flat buffer and the activations in one workspace [M, K_1 + N_1 + ... + N_S]
(the input first, then each stage's output), so one launch takes every stage through offsets (`GemvChain`).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from .gemv import ROWS_MAX_M

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install without Triton: the reference still works
    triton = None

META_FIELDS = 5  # per stage (int32): weight offset, N, K, x offset, y offset (elements)


def gemv_chain_reference(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every stage's output as separate GEMMs compute them: y_s = y_{s-1} @ W_s^T, rounded to x's dtype."""
    out, y = [], x
    for w in weights:
        y = torch.mm(y, w.t())
        out.append(y)
    return out


def check_chain(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Raise ValueError naming the first thing wrong with a chain's shapes or dtypes."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= ROWS_MAX_M:
        raise ValueError(f"gemv_chain: x must be [M, K] with 1 <= M <= {ROWS_MAX_M}, got {tuple(x.shape)}")
    if not weights:
        raise ValueError("gemv_chain: needs at least one weight")
    k = x.shape[1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"gemv_chain: weight {i} must be [N, {k}] (K = the previous stage's N), "
                             f"got {tuple(w.shape)}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"gemv_chain: weight {i} is {w.dtype} on {w.device}, x is {x.dtype} on {x.device}")
        k = w.shape[0]


if triton is not None:

    @triton.jit
    def _chain_tile(w_ptr, act_ptr, meta_ptr, prefix_ptr, ctr_ptr, M, act_row, t, epoch, S: tl.constexpr,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BACKOFF_NS: tl.constexpr):
        """Tile t (a ticket less its launch's base) of launch `epoch`: wait for the previous stage, multiply,
        publish."""
        stage = t * 0
        for s in tl.static_range(1, S):  # the stage whose ticket range holds t
            stage += (t >= tl.load(prefix_ptr + s)).to(stage.dtype)
        first = tl.load(prefix_ptr + stage)
        meta = meta_ptr + stage * 5  # META_FIELDS
        w_off = tl.load(meta)
        n = tl.load(meta + 1)
        k = tl.load(meta + 2)
        x_off = tl.load(meta + 3)
        y_off = tl.load(meta + 4)

        rm = tl.arange(0, M_PAD)
        rn = (t - first) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < n
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + w_off + rn[:, None] * k
        # the first weight tile loads before the wait: it does not depend on the previous stage
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < k), other=0.0)
        if stage > 0:
            done = ctr_ptr + 1 + stage - 1
            need = (epoch + 1) * (first - tl.load(prefix_ptr + stage - 1))  # the previous stage, this launch
            while tl.load(done, volatile=True) < need:  # plain reads while spinning: no RMW traffic on the counter
                if BACKOFF_NS > 0:  # sleep between reads: fewer issue slots and L2 requests taken from the producers
                    tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,n", [BACKOFF_NS],
                                              dtype=tl.int32, is_pure=False, pack=1)
            tl.atomic_add(done, 0, sem="acquire")  # then one acquire, ordering the reads of x after it
            tl.debug_barrier()

        x_rows = act_ptr + rm[:, None, None] * act_row + x_off
        x_mask = m_ok[:, None, None] & n_ok[None, :, None]
        # x is written by other programs of this launch: read through L2 (.cg), never a stale L1 line
        x = tl.load(x_rows + kk[None, None, :] + 0 * rn[None, :, None], mask=x_mask & (kk[None, None, :] < k),
                    other=0.0, cache_modifier=".cg")
        acc3 = w.to(tl.float32)[None, :, :] * x.to(tl.float32)
        for k0 in range(BLOCK_K, k, BLOCK_K):
            rk = k0 + kk
            k_ok = rk < k
            w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + rk[None, None, :] + 0 * rn[None, :, None], mask=x_mask & k_ok[None, None, :],
                        other=0.0, cache_modifier=".cg")
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)
        acc = tl.sum(acc3, axis=2)
        y_ptrs = act_ptr + rm[:, None] * act_row + y_off + rn[None, :]
        tl.store(y_ptrs, acc.to(act_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
        tl.debug_barrier()  # every thread's stores precede the publication
        tl.atomic_add(ctr_ptr + 1 + stage, 1, sem="release")

    @triton.jit
    def _gemv_chain_kernel(w_ptr, act_ptr, meta_ptr, prefix_ptr, ctr_ptr, M, act_row,
                           S: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BACKOFF_NS: tl.constexpr = 0, PERSISTENT: tl.constexpr = False):
        # ctr (int64): [ticket, done_1 .. done_S], counting up across launches: launch e (0, 1, ...) leaves done_s at
        # (e + 1) * T_s (and, ticketed, hands out tickets [e * total, (e + 1) * total)), so nothing is reset (a CUDA
        # graph replays the launch with no memset; replays on one stream never overlap)
        total = tl.load(prefix_ptr + S)
        if PERSISTENT:
            # a fixed grid of co-resident programs, program p taking tiles p, p + P, ... in order; the launch's epoch
            # is the last stage's count the previous launch left (no ticket atomics: GemvChain keeps P <= every stage's
            # tile count, so no tile of the last stage can publish before every program has read it)
            last = total - tl.load(prefix_ptr + S - 1)
            epoch = tl.load(ctr_ptr + S, volatile=True) // last
            for t in range(tl.program_id(0), total, tl.num_programs(0)):
                _chain_tile(w_ptr, act_ptr, meta_ptr, prefix_ptr, ctr_ptr, M, act_row, t, epoch, S, M_PAD, BLOCK_N,
                            BLOCK_K, BACKOFF_NS)
        else:
            ticket = tl.atomic_add(ctr_ptr, 1, sem="relaxed")
            epoch = ticket // total
            t = (ticket - epoch * total).to(tl.int32)
            _chain_tile(w_ptr, act_ptr, meta_ptr, prefix_ptr, ctr_ptr, M, act_row, t, epoch, S, M_PAD, BLOCK_N,
                        BLOCK_K, BACKOFF_NS)


class GemvChain:
    """S GEMVs chained in one launch on static buffers: set `input`, call `launch()`, read `outputs`.

    block_n: output columns per tile (a power of two); block_k: the K step (a power of two >= 16); backoff_ns: a
    waiting tile sleeps this long between reads of the counter (CUDA only: `nanosleep`; 0 spins); persistent: one
    program per SM walks its tiles in order (no ticket atomics, no program started per tile) instead of a program
    per tile taking a ticket. The weights are copied into one flat buffer (an experiment's layout: an engine would
    pass its own tensors)."""

    def __init__(self, weights: list[torch.Tensor], m: int, block_n: int = 4, block_k: int = 1024,
                 num_warps: int = 4, backoff_ns: int = 0, persistent: bool = False):
        if triton is None:
            raise RuntimeError("gemv_chain: triton is not installed")
        for name, v, least in (("block_n", block_n, 1), ("block_k", block_k, 16)):
            if v < least or v & (v - 1):
                raise ValueError(f"gemv_chain: {name} must be a power of two >= {least}, got {v}")
        if not weights:
            raise ValueError("gemv_chain: needs at least one weight")
        dev, dtype = weights[0].device, weights[0].dtype
        check_chain(torch.empty(m, weights[0].shape[1], dtype=dtype, device=dev), weights)
        if not 0 <= backoff_ns < 2 ** 20:
            raise ValueError(f"gemv_chain: backoff_ns must be in 0..2^20, got {backoff_ns}")
        self.m, self.block_n, self.block_k, self.num_warps = m, block_n, block_k, num_warps
        self.backoff_ns, self.persistent = backoff_ns, persistent
        # activation columns: the input, then each stage's output; stage i reads cols[i]: and writes cols[i + 1]:
        cols = list(accumulate([weights[0].shape[1]] + [w.shape[0] for w in weights], initial=0))
        w_offs = list(accumulate((w.numel() for w in weights), initial=0))
        prefix = list(accumulate((-(-w.shape[0] // block_n) for w in weights), initial=0))  # tiles before stage i
        if w_offs[-1] >= 2 ** 31 or m * cols[-1] >= 2 ** 31:
            raise ValueError(f"gemv_chain: {w_offs[-1]} weights / {m * cols[-1]} activations: offsets are int32")
        self.act = torch.zeros(m, cols[-1], dtype=dtype, device=dev)
        self.flat = torch.cat([w.contiguous().reshape(-1) for w in weights])
        meta = [v for i, w in enumerate(weights) for v in (w_offs[i], *w.shape, cols[i], cols[i + 1])]
        self.meta = torch.tensor(meta, dtype=torch.int32, device=dev)
        self.prefix = torch.tensor(prefix, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(1 + len(weights), dtype=torch.int64, device=dev)
        self.tiles = prefix[-1]
        # the persistent grid: every program must be resident at once (static tiles: a waiting program may hold the
        # only slot its producer could use otherwise), so one per SM, and at most every stage's tile count (the epoch
        # rule in the kernel); the interpreter runs programs one after another: one program, in ticket order
        fewest = min(b - a for a, b in zip(prefix[:-1], prefix[1:]))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        self.grid = min(sms, fewest) if persistent else self.tiles
        self.input = self.act[:, cols[0]:cols[1]]
        self.outputs = [self.act[:, cols[i]:cols[i + 1]] for i in range(1, len(cols) - 1)]

    def launch(self) -> torch.Tensor:
        """Run every stage once (reads `input`, writes `outputs`); returns the last output."""
        _gemv_chain_kernel[(self.grid,)](
            self.flat, self.act, self.meta, self.prefix, self.counters, self.m, self.act.stride(0),
            S=len(self.outputs), M_PAD=triton.next_power_of_2(self.m), BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            BACKOFF_NS=self.backoff_ns, PERSISTENT=self.persistent, num_warps=self.num_warps)
        return self.outputs[-1]
