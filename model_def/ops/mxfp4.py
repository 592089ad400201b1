"""MXFP4 weights (OCP Microscaling FP4, the format K3's checkpoint ships its routed experts in).

Layout (compressed-tensors `mxfp4-pack-quantized`, group 32), for a weight W [out, in]:

    weight_packed  uint8 [out, in / 2]   two FP4 E2M1 codes per byte: element 2j in the LOW nibble,
                                         element 2j+1 in the HIGH nibble
    weight_scale   uint8 [out, in / 32]  E8M0 shared exponent per group of 32 inputs: 2^(s - 127);
                                         s = 255 is NaN (OCP MX spec)

    W[o, i] = e2m1(code[o, i]) * 2^(scale[o, i // 32] - 127)

E2M1 code: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; the 8 magnitudes are
0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent 0 is subnormal: 0 and 0.5). Stacked expert tensors keep the
same layout with a leading expert dim ([E, out, in/2] and [E, out, in/32]).

This module is the CPU reference: exact dequantization (every MXFP4 value is exact in fp32 and,
for scales in bf16's range, in bf16), and a round-to-nearest quantizer used to make test
checkpoints (not the QAT quantizer K3 was trained with; it only has to produce valid codes).
"""
from __future__ import annotations

import torch

GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# magnitude of each 3-bit (exponent, mantissa) pattern; the sign bit negates
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


class MXFP4FormatError(ValueError):
    """Packed codes / scales whose dtype or shape does not describe one MXFP4 weight."""


def e2m1_table(device=None) -> torch.Tensor:
    """fp32 value of each of the 16 codes (8..15 are the negatives of 0..7; code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor, what: str = "MXFP4 weight") -> tuple[int, ...]:
    """Raise MXFP4FormatError naming the problem; returns the dequantized shape (..., out, in)."""
    if packed.dtype != torch.uint8:
        raise MXFP4FormatError(f"{what}: packed codes must be uint8, got {packed.dtype}")
    if scale.dtype != torch.uint8:
        raise MXFP4FormatError(f"{what}: E8M0 scales must be uint8, got {scale.dtype}")
    if packed.dim() < 2 or packed.dim() != scale.dim():
        raise MXFP4FormatError(f"{what}: packed {list(packed.shape)} and scales {list(scale.shape)} must both be "
                               f"[..., out, in/2] and [..., out, in/{GROUP}]")
    cols = packed.shape[-1] * 2
    if cols % GROUP:
        raise MXFP4FormatError(f"{what}: input width {cols} (packed {packed.shape[-1]} bytes per row) is not a "
                               f"multiple of the group size {GROUP}")
    want = tuple(packed.shape[:-1]) + (cols // GROUP,)
    if tuple(scale.shape) != want:
        raise MXFP4FormatError(f"{what}: scales have shape {list(scale.shape)}, expected {list(want)} (one E8M0 "
                               f"exponent per {GROUP} inputs of packed {list(packed.shape)})")
    return tuple(packed.shape[:-1]) + (cols,)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> the 4-bit codes [..., n] (low nibble first)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., n] (n even) -> uint8 [..., n/2], element 2j in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               check_nan_scales: bool = True) -> torch.Tensor:
    """Exact MXFP4 -> `dtype`: [..., out, in/2] codes and [..., out, in/32] scales -> [..., out, in]."""
    shape = check_mxfp4(packed, scale)
    if check_nan_scales and bool((scale == E8M0_NAN).any()):
        raise MXFP4FormatError(f"MXFP4 weight: {int((scale == E8M0_NAN).sum())} E8M0 scale(s) are 255 (NaN)")
    values = e2m1_table(packed.device)[unpack_codes(packed).long()]
    factor = torch.exp2(scale.to(torch.float32) - E8M0_BIAS)
    out = values.view(*shape[:-1], shape[-1] // GROUP, GROUP) * factor.unsqueeze(-1)
    return out.view(shape).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of w [..., out, in] (in % 32 == 0): (packed uint8, scales uint8).

    Scale per group: the smallest power of two that brings the group's max |w| to <= 6 (so nothing
    clips); codes: the nearest E2M1 value (ties to the lower magnitude)."""
    if w.shape[-1] % GROUP:
        raise MXFP4FormatError(f"quantize: input width {w.shape[-1]} is not a multiple of {GROUP}")
    w = w.float()
    groups = w.view(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = groups.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax.clamp_min(2.0 ** -126) / E2M1_MAX)).clamp(-127, 127)
    scale = (exp + E8M0_BIAS).to(torch.uint8)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    mags = E2M1_MAGNITUDES
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:])], device=w.device)
    idx = torch.bucketize(scaled.abs(), midpoints)  # thresholds strictly below: a tie goes to the lower value
    codes = idx + 8 * (scaled < 0).long()
    return pack_codes(codes.view(w.shape)), scale
