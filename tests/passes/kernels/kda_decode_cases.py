"""Random inputs for k3::fused_kda_decode at any shape (shared by the interpreter script, the CPU
tests and the GPU tests / microbenchmark): a KDA layer's post-GEMM activations, weights shaped as
the model's, and conv / ssm pools with random contents in more slots than the batch uses."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise: max|a - b| / max|b| (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@dataclass
class Case:
    x: list  # q_in, k_in, v_in [B, C]
    conv_weights: list  # 3 x [C, width]
    f: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    beta_logits: torch.Tensor
    gate: torch.Tensor
    norm_weight: torch.Tensor
    conv_pool: torch.Tensor
    ssm_pool: torch.Tensor
    layer: int
    slots: torch.Tensor
    lower_bound: float | None
    norm_eps: float
    dtype: torch.dtype
    f_b_weight: torch.Tensor | None = None  # f is then f_b_proj's low-rank input [B, R]
    g_b_weight: torch.Tensor | None = None  # gate is then g_b_proj's low-rank input [B, R]

    def args(self) -> tuple:
        """The op's arguments, with private copies of the pools (so two runs start equal)."""
        return (*self.x, *self.conv_weights, self.f, self.dt_bias, self.a_log, self.beta_logits, self.gate,
                self.norm_weight, self.conv_pool.clone(), self.ssm_pool.clone(), self.layer, self.slots,
                self.lower_bound, self.norm_eps, self.f_b_weight, self.g_b_weight)

    def untouched_slots(self) -> list[int]:
        used = set(self.slots.tolist())
        return [s for s in range(self.ssm_pool.shape[0]) if s not in used]


def make_case(batch: int, heads: int, head_dim: int, lower_bound: float | None, dtype=torch.float32,
              layer: int = 0, num_layers: int = 2, slots=None, width: int = 4, strided_inputs: bool = False,
              f_scale: float = 1.0, seed: int = 0, device="cpu", f_rank: int = 0, g_rank: int = 0) -> Case:
    """f_rank / g_rank > 0: f and the output gate come as low-rank inputs plus up-projection weights."""
    gen = torch.Generator().manual_seed(seed)
    c = heads * head_dim

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    if slots is None:
        slots = list(range(batch))
    num_slots = max(slots, default=-1) + 2
    if strided_inputs:  # column blocks of one merged GEMM output, like the captured graph's split
        merged = randn(batch, 4 * c + heads)
        x = [merged[:, i * c:(i + 1) * c] for i in range(3)]
        f = merged[:, 3 * c:4 * c]
        beta_logits = merged[:, 4 * c:]
    else:
        x = [randn(batch, c) for _ in range(3)]
        f = randn(batch, c, scale=f_scale)
        beta_logits = randn(batch, heads)
    conv_weights = [randn(c, width, scale=1 / math.sqrt(width)) for _ in range(3)]
    f_b_weight = g_b_weight = None
    if f_rank:
        f, f_b_weight = randn(batch, f_rank, scale=f_scale), randn(c, f_rank, scale=1 / math.sqrt(f_rank))
    if lower_bound is None:  # the Kimi Linear init ranges (spec §1.2)
        a_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()
    else:
        a_log = 0.5 * torch.randn(heads, generator=gen)
    dt = torch.empty(c).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    gate = randn(batch, heads, head_dim)
    if g_rank:
        gate, g_b_weight = randn(batch, g_rank), randn(c, g_rank, scale=1 / math.sqrt(g_rank))
    norm_weight = 1.0 + randn(head_dim, scale=0.1)
    conv_pool = randn(num_slots, num_layers, 3 * c, width - 1)
    ssm_pool = (0.3 * torch.randn(num_slots, num_layers, heads, head_dim, head_dim, generator=gen)).to(device)
    return Case(x, conv_weights, f, dt_bias.to(dtype).to(device), a_log.to(dtype).to(device), beta_logits, gate,
                norm_weight, conv_pool, ssm_pool, layer, torch.tensor(slots, dtype=torch.int64, device=device),
                lower_bound, 1e-5, dtype, f_b_weight, g_b_weight)
