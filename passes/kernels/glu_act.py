"""The dense MLP's GLU activation in one kernel (pass p17_dense_glu puts it into graphs).

`torch.ops.k3.glu_act(gate, up, act, beta, linear_beta) -> h`, gate and up [N, I] (column blocks of the merged
gate/up GEMM's output: rows may be strided, columns contiguous), h [N, I] in gate's dtype:

    act "situ" (K3, spec §4.3): h = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), in fp32,
                                rounded once (`model_def.ops.moe_math.glu_act`: its 12 ATen kernels in a bf16 step)
    act "silu" (Kimi Linear):   h = silu(g) * u, rounded as F.silu(g) * u rounds (silu(g) to gate's dtype, then the
                                product): 2 ATen kernels

One program per (row, block of BLOCK columns). CPU (and any device without Triton) runs the reference, which is
`glu_act` itself. Testing without a GPU: TRITON_INTERPRET=1 before this module is imported runs the kernel on CPU
tensors (tests/passes/kernels/interpret_glu_act.py).
"""
from __future__ import annotations

import torch

from k3compile.model_def.ops.moe_math import glu_act as glu_act_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the reference
    triton = None

ACTS = {"silu": 0, "situ": 1}
BLOCK = 1024  # columns per program (the 6B dense MLP's 8192: 8 programs a token)


def check_args(gate: torch.Tensor, up: torch.Tensor, act: str) -> None:
    if act not in ACTS:
        raise ValueError(f"glu_act: unknown activation {act!r} (known: {', '.join(ACTS)})")
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"glu_act: gate and up must be [N, I] of one dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")


if triton is not None:
    from .moe_decode import _glu  # the experts' SiTU-GLU in fp32 (spec §4.3), the same expression in both kernels

    @triton.jit
    def _glu_act_kernel(g_ptr, g_stride, u_ptr, u_stride, out_ptr, I, beta, linear_beta, ACT: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 1:
            h = _glu(g, u, beta, linear_beta, 1)
        else:  # F.silu(g) * u: silu rounded to the output dtype first, as the two ATen ops round
            s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
            h = s * u
        tl.store(out_ptr + row * I + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


def glu_act_triton(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float, linear_beta: float,
                   block: int = BLOCK, num_warps: int = 4) -> torch.Tensor:
    """Launch the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    check_args(gate, up, act)
    if triton is None:
        raise RuntimeError("glu_act: triton is not installed")
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    n, inter = gate.shape
    out = torch.empty(n, inter, dtype=gate.dtype, device=gate.device)
    if n == 0 or inter == 0:
        return out
    block = min(block, triton.next_power_of_2(inter))
    _glu_act_kernel[(n, triton.cdiv(inter, block))](gate, gate.stride(0), up, up.stride(0), out, inter, float(beta),
                                                    float(linear_beta), ACT=ACTS[act], BLOCK=block,
                                                    num_warps=num_warps)
    return out


@torch.library.custom_op("k3::glu_act", mutates_args=())
def glu_act(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """The dense MLP's GLU activation in one op; see module doc."""
    check_args(gate, up, act)
    return glu_act_reference(gate, up, act, beta, linear_beta).contiguous()


@glu_act.register_kernel("cuda")
def _glu_act_cuda(gate, up, act, beta, linear_beta):
    if triton is None:
        return glu_act_reference(gate, up, act, beta, linear_beta).contiguous()
    with torch.cuda.device(gate.device):
        return glu_act_triton(gate, up, act, beta, linear_beta)


@glu_act.register_fake
def _glu_act_fake(gate, up, act, beta, linear_beta):
    return gate.new_empty(gate.shape)
