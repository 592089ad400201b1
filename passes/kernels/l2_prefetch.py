"""L2 prefetch of a kernel's static weights while it waits for the kernel before it (PDL).

Why: a decode step is a chain of kernels, some streaming weights from HBM (GEMVs, MoE experts) and some bound by
latency (the KDA recurrence, MLA attention, the router and its top-k). Under PDL the next kernel's programs are
already resident while a latency-bound kernel runs, but they sit in `gdc_wait` and HBM idles. A program that
asks L2 for its own weight slice before the wait turns that idle time into transfers its loads then hit in L2.
The values loaded are the same (a prefetch moves no data into registers), so a kernel computes the same bits
with and without it.

The request is PTX `cp.async.bulk.prefetch.L2.global [addr], size` (sm90+): one instruction per contiguous byte
range, no registers, no completion to wait for. Its address and size must be multiples of 16 bytes: callers
check that on the host (`region_ok`) and pass prefetch off otherwise. Triton's interpreter cannot run inline PTX,
so callers enable it only together with PDL (never under TRITON_INTERPRET=1, see kernels/pdl.py).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = None

ALIGN = 16  # bytes: what the bulk prefetch needs of an address and of a size


def region_ok(tensor: torch.Tensor, row_bytes: int, first_byte: int = 0) -> bool:
    """Whether a region of `tensor`'s storage that starts `first_byte` into the tensor, in rows `row_bytes` apart,
    can be prefetched in whole 16-byte units: the data pointer, the row pitch and the offset all 16-byte multiples."""
    return tensor.data_ptr() % ALIGN == 0 and row_bytes % ALIGN == 0 and first_byte % ALIGN == 0


if triton is not None:

    @triton.jit
    def _bulk_prefetch(ptrs, nbytes):
        """One bulk L2 prefetch per element (none where nbytes is 0); the dummy result keeps Triton's type rules."""
        return tl.inline_asm_elementwise(
            "{\n .reg .pred p;\n setp.ne.u32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global [$1], $2;\n"
            " mov.u32 $0, 0;\n}",
            "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_rows_l2(base, segments, seg_bytes, pitch, PIECES: tl.constexpr):
        """Ask L2 for `segments` byte ranges of seg_bytes each, `pitch` bytes apart, from `base` (any pointer type;
        base, seg_bytes and pitch 16-byte multiples). PIECES requests per round (32 x num_warps: one per thread):
        each range is cut into PIECES // segments pieces when it has fewer than PIECES ranges."""
        b = base.to(tl.pointer_type(tl.int8))
        per_seg = tl.maximum(PIECES // segments, 1)
        chunk = tl.cdiv(tl.cdiv(seg_bytes, per_seg), 16) * 16
        segs_per_round = PIECES // per_seg
        i = tl.arange(0, PIECES)
        sub = i % per_seg
        for s0 in range(0, segments, segs_per_round):
            seg = s0 + i // per_seg
            lo = sub * chunk
            size = tl.minimum(tl.maximum(seg_bytes - lo, 0), chunk)
            size = tl.where((seg < segments) & (i < segs_per_round * per_seg), size, 0)
            _bulk_prefetch(b + seg.to(tl.int64) * pitch + lo, size.to(tl.int32))
