"""Model sizes computed from the module tree on the meta device (never from a separate formula).

Active parameters per token: everything except the embedding lookup, with routed experts counted
at top_k / num_experts of their size (lm_head included, as in the K3 / Kimi Linear model cards).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from k3compile.model_def.cache import CacheSpec
from k3compile.model_def.dtypes import DTYPES  # noqa: F401  (re-exported: the CLI's commands read it here)
from k3compile.model_def.loader import build_model, resolve_config


@dataclass
class ModelInfo:
    name: str
    layers: int
    kda_layers: int
    mla_layers: int
    moe_layers: int
    total_params: int
    active_params: int
    weight_bytes: int
    weight_bytes_per_rank: int
    tp_size: int
    kda_state_bytes_per_request: int  # fp32 recurrent states, all KDA layers, one TP rank
    conv_state_bytes_per_request: int
    mla_kv_bytes_per_token: int  # all MLA layers (latent cache is replicated per rank without DCP)


def model_info(name_or_path: str, dtype: str = "bf16", tp_size: int = 1) -> ModelInfo:
    cfg = resolve_config(name_or_path)
    model = build_model(cfg, DTYPES[dtype], "meta")
    total = active = per_rank = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name:
            active += n * cfg.num_experts_per_token // cfg.num_experts
        elif "embed_tokens" not in name:
            active += n
        # matrices shard across TP ranks (heads / intermediate / experts / vocab); vectors are replicated
        per_rank += n // tp_size if p.dim() >= 2 else n
    spec = CacheSpec.from_config(cfg, DTYPES[dtype], tp_size)
    return ModelInfo(
        name=cfg.name, layers=cfg.num_hidden_layers, kda_layers=len(cfg.kda_layers), mla_layers=len(cfg.mla_layers),
        moe_layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)), total_params=total,
        active_params=active, weight_bytes=total * DTYPES[dtype].itemsize,
        weight_bytes_per_rank=per_rank * DTYPES[dtype].itemsize, tp_size=tp_size,
        kda_state_bytes_per_request=spec.ssm_bytes_per_slot, conv_state_bytes_per_request=spec.conv_bytes_per_slot,
        mla_kv_bytes_per_token=spec.kv_bytes_per_token)


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "K" if unit else "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {suffix}{unit}".rstrip()
    return f"{n:.0f} {unit}".rstrip()


def render(info: ModelInfo) -> str:
    i = info
    lines = [
        f"model                 {i.name}",
        f"layers                {i.layers} ({i.kda_layers} KDA + {i.mla_layers} MLA; {i.moe_layers} MoE)",
        f"parameters            {human(i.total_params)} total, {human(i.active_params)} active per token",
        f"weights               {human(i.weight_bytes, 'B')} ({human(i.weight_bytes_per_rank, 'B')} per rank at TP {i.tp_size})",
        f"KDA state / request   {human(i.kda_state_bytes_per_request, 'B')} fp32 recurrent state per rank at TP {i.tp_size}"
        f" (+ {human(i.conv_state_bytes_per_request, 'B')} short-conv windows)",
        f"MLA KV / token        {human(i.mla_kv_bytes_per_token, 'B')} over {i.mla_layers} MLA layers",
    ]
    return "\n".join(lines)


def as_dict(info: ModelInfo) -> dict:
    return asdict(info)
