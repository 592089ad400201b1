"""One config family for Kimi-Linear and Kimi K3, the presets, and Hugging Face config I/O.

The config is the single source of truth for shapes; everything else (module tree, cache
layout, `k3compile info`) is derived from it. Field names follow the Hugging Face
`kimi_linear` config where one exists so that `to_hf_dict()` is loadable by transformers.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A config that is missing fields, contradicts itself, or names an unknown model."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 9
    # 0-based layer kinds: "kda" (Kimi Delta Attention) or "mla" (gated NoPE-MLA)
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # --- KDA ---
    kda_num_heads: int = 2
    kda_head_dim: int = 16
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # None: softplus decay (Kimi Linear); -5.0: K3 bounded gate
    kda_full_rank_gate: bool = False  # K3: g_proj D -> H*V; Kimi Linear: g_a_proj/g_b_proj
    # --- MLA ---
    num_attention_heads: int = 2
    q_lora_rank: int | None = None
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mla_output_gate: bool = False
    # --- MLP / MoE ---
    hidden_act: str = "silu"  # "silu" or "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 32
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    latent_size: int | None = None  # routed_expert_hidden_size: LatentMoE width (K3)
    latent_norm: bool = False  # latent_moe_use_norm (K3 "Stable" LatentMoE)
    expert_quant: str | None = None  # "mxfp4": routed experts stored MXFP4 (K3 checkpoint; ops/mxfp4.py)
    # --- Block Attention Residuals (K3) ---
    attn_res_block_size: int | None = None  # decoder layers per block; None = plain residual
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_schedule(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        validate(self)

    # --- derived shapes ---
    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values cached per token per MLA layer: latent + the unrotated 'rope' slot (576 in K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def is_k3(self) -> bool:
        return self.attn_res_block_size is not None or self.gate_lower_bound is not None

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # --- Hugging Face I/O ---
    def to_hf_dict(self) -> dict:
        """A `kimi_linear` config.json (K3 fields included when used)."""
        d = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "linear_attn_config": {
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "kda_layers": [i + 1 for i in self.kda_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "hidden_act": self.hidden_act,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
        }
        if self.gate_lower_bound is not None:
            d["linear_attn_config"]["gate_lower_bound"] = self.gate_lower_bound
        if self.kda_full_rank_gate:
            d["linear_attn_config"]["use_full_rank_gate"] = True
        if self.mla_output_gate:
            d["mla_use_output_gate"] = True
        if self.hidden_act == "situ":
            d["activation_situ_beta"] = self.situ_beta
            d["activation_situ_linear_beta"] = self.situ_linear_beta
        if self.latent_size is not None:
            d["routed_expert_hidden_size"] = self.latent_size
            d["latent_moe_use_norm"] = self.latent_norm
        if self.attn_res_block_size is not None:
            d["attn_res_block_size"] = self.attn_res_block_size
        if self.expert_quant == "mxfp4":
            d["quantization_config"] = mxfp4_quantization_config()
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict, name: str = "checkpoint") -> "ModelConfig":
        return config_from_hf_dict(raw, name)


def default_schedule(num_layers: int) -> tuple[str, ...]:
    """K3's rule: MLA at 1-based layers 4, 8, ..., and always at the last layer."""
    return tuple("mla" if (i + 1) % 4 == 0 or i == num_layers - 1 else "kda" for i in range(num_layers))


_KNOWN_ACTS = ("silu", "situ")


def validate(c: ModelConfig) -> None:
    def need(cond, msg):
        if not cond:
            raise ConfigError(f"config '{c.name}': {msg}")

    need(len(c.layer_types) == c.num_hidden_layers,
         f"layer schedule has {len(c.layer_types)} entries but num_hidden_layers = {c.num_hidden_layers}")
    bad = sorted(set(c.layer_types) - {"kda", "mla"})
    need(not bad, f"unknown layer kinds {bad} (expected 'kda' or 'mla')")
    for fname in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "conv_kernel_size"):
        need(getattr(c, fname) > 0, f"{fname} must be > 0, got {getattr(c, fname)}")
    need(c.qk_rope_head_dim >= 0, "qk_rope_head_dim must be >= 0")
    need(c.hidden_act in _KNOWN_ACTS, f"hidden_act '{c.hidden_act}' is not supported (expected one of {_KNOWN_ACTS})")
    if c.gate_lower_bound is not None:
        need(-5.0 <= c.gate_lower_bound < 0, f"gate_lower_bound must be in [-5, 0), got {c.gate_lower_bound}")
    if c.num_experts:
        need(0 < c.num_experts_per_token <= c.num_experts,
             f"num_experts_per_token = {c.num_experts_per_token} must be in 1..num_experts ({c.num_experts})")
        need(c.num_expert_group >= 1 and c.num_experts % c.num_expert_group == 0,
             f"num_experts ({c.num_experts}) must divide into num_expert_group ({c.num_expert_group}) groups")
        need(1 <= c.topk_group <= c.num_expert_group,
             f"topk_group ({c.topk_group}) must be in 1..num_expert_group ({c.num_expert_group})")
        need(c.moe_intermediate_size > 0, "moe_intermediate_size must be > 0")
        kept = c.topk_group * (c.num_experts // c.num_expert_group)
        need(c.num_experts_per_token <= kept,
             f"num_experts_per_token ({c.num_experts_per_token}) exceeds the experts left by group limiting "
             f"(topk_group {c.topk_group} x {c.num_experts // c.num_expert_group} per group = {kept})")
    need(c.first_k_dense_replace >= 0 and c.moe_layer_freq >= 1, "first_k_dense_replace >= 0 and moe_layer_freq >= 1")
    if c.latent_size is not None:
        need(0 < c.latent_size, f"routed_expert_hidden_size must be > 0, got {c.latent_size}")
    need(not (c.latent_norm and c.latent_size is None), "latent_moe_use_norm needs routed_expert_hidden_size")
    if c.attn_res_block_size is not None:
        need(c.attn_res_block_size >= 1, f"attn_res_block_size must be >= 1, got {c.attn_res_block_size}")
    if c.q_lora_rank is not None:
        need(c.q_lora_rank > 0, f"q_lora_rank must be > 0 or null, got {c.q_lora_rank}")
    need(c.expert_quant in (None, "mxfp4"), f"expert_quant must be None or 'mxfp4', got {c.expert_quant!r}")
    if c.expert_quant == "mxfp4":
        width = c.latent_size or c.hidden_size
        need(width % 32 == 0 and c.moe_intermediate_size % 32 == 0,
             f"MXFP4 experts need input widths divisible by the group size 32 (expert width {width}, "
             f"moe_intermediate_size {c.moe_intermediate_size})")


# ----------------------------------------------------------------------------------------------
# Presets (spec §7). Full-size ones are meta-device only.

def _k3_like(name, **kw) -> ModelConfig:
    base = dict(name=name, gate_lower_bound=-5.0, kda_full_rank_gate=True, mla_output_gate=True,
                hidden_act="situ", num_shared_experts=2, routed_scaling_factor=1.0, latent_norm=True,
                bos_token_id=163584, eos_token_id=163586, pad_token_id=163839)
    base.update(kw)
    return ModelConfig(**base)


def _k3() -> ModelConfig:
    return _k3_like("k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93, kda_num_heads=96,
                    kda_head_dim=128, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=33792,
                    num_experts=896, num_experts_per_token=16, moe_intermediate_size=3072, latent_size=3584,
                    attn_res_block_size=12)


def _k3_mini(name, hidden, heads, q_lora, dense, experts, latent) -> ModelConfig:
    return _k3_like(name, vocab_size=163840, hidden_size=hidden, num_hidden_layers=29, kda_num_heads=heads,
                    kda_head_dim=128, num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=dense,
                    num_experts=experts, num_experts_per_token=8, moe_intermediate_size=512,
                    latent_size=latent, attn_res_block_size=4)


def _k3_tiny() -> ModelConfig:
    # byte-level tokenizer ids: 256 = bos, 257 = eos, 258 = pad (vocab 512 leaves room)
    return _k3_like("k3-tiny", vocab_size=512, hidden_size=64, num_hidden_layers=9, kda_num_heads=2,
                    kda_head_dim=16, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                    num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, latent_size=32,
                    attn_res_block_size=4, bos_token_id=256, eos_token_id=257, pad_token_id=258,
                    max_position_embeddings=4096)


def _kimi_linear_48b() -> ModelConfig:
    return ModelConfig(name="kimi-linear-48b", vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
                       layer_types=tuple("mla" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "kda" for i in range(27)),
                       kda_num_heads=32, kda_head_dim=128, num_attention_heads=32, q_lora_rank=None,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       intermediate_size=9216, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
                       moe_intermediate_size=1024, routed_scaling_factor=2.446, hidden_act="silu",
                       bos_token_id=163584, eos_token_id=163586, pad_token_id=163839)


def _kimi_linear_tiny() -> ModelConfig:
    # same skeleton as 48B-A3B: softplus KDA gate, low-rank output gate, MLA without q-LoRA or output
    # gate, plain residual, full-width MoE with one shared expert; MLA at 1-based layers 4 and 6.
    return ModelConfig(name="kimi-linear-tiny", vocab_size=512, hidden_size=64, num_hidden_layers=6,
                       layer_types=("kda", "kda", "kda", "mla", "kda", "mla"), kda_num_heads=2, kda_head_dim=16,
                       num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, num_experts=8,
                       num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                       routed_scaling_factor=2.446, hidden_act="silu", bos_token_id=256, eos_token_id=257,
                       pad_token_id=258, max_position_embeddings=4096)


PRESETS = {
    "k3": _k3,
    "k3-mini-6b": lambda: _k3_mini("k3-mini-6b", 2048, 16, 768, 8192, 96, 1024),
    "k3-mini-3b": lambda: _k3_mini("k3-mini-3b", 1536, 12, 512, 6144, 64, 768),
    "k3-tiny": _k3_tiny,
    "kimi-linear-48b": _kimi_linear_48b,
    "kimi-linear-tiny": _kimi_linear_tiny,
}
META_ONLY_PRESETS = {"k3", "kimi-linear-48b"}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}'; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


# ----------------------------------------------------------------------------------------------
# Hugging Face config.json -> ModelConfig

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_attn_config")


def config_from_hf_dict(raw: dict, name: str = "checkpoint") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: config.json must hold a JSON object")
    d = raw
    if "text_config" in raw:  # K3's multimodal wrapper: the decoder config sits inside
        d = raw["text_config"]
        if not isinstance(d, dict):
            raise ConfigError(f"{name}: text_config must be a JSON object")
    mt = d.get("model_type")
    if mt not in ("kimi_linear", "kimi_k3", None):
        raise ConfigError(f"{name}: unknown model_type '{mt}' (k3compile reads 'kimi_linear' and K3 configs)")
    d = _with_linear_attn_config(d)
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ConfigError(f"{name}: config.json is missing required field(s): {', '.join(missing)}")
    lac = d["linear_attn_config"]
    n = d["num_hidden_layers"]
    for k in ("full_attn_layers", "kda_layers", "num_heads", "head_dim"):
        if lac.get(k) is None:
            raise ConfigError(f"{name}: linear_attn_config is missing '{k}'")
    full, kda = list(lac["full_attn_layers"]), list(lac["kda_layers"])
    overlap = sorted(set(full) & set(kda))
    if overlap:
        raise ConfigError(f"{name}: layers {overlap} are listed both in full_attn_layers and kda_layers")
    covered = sorted(set(full) | set(kda))
    if covered != list(range(1, n + 1)):
        raise ConfigError(f"{name}: full_attn_layers + kda_layers (1-based) must cover layers 1..{n} exactly; "
                          f"got {covered}")
    nkv = d.get("num_key_value_heads", d["num_attention_heads"])
    if nkv not in (None, d["num_attention_heads"]):
        raise ConfigError(f"{name}: num_key_value_heads ({nkv}) must equal num_attention_heads "
                          f"({d['num_attention_heads']}) for MLA")
    if d.get("mla_use_nope") is False:
        raise ConfigError(f"{name}: mla_use_nope = false (rotary MLA) is not supported; Kimi models use NoPE")
    if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{name}: moe_router_activation_func '{d['moe_router_activation_func']}' unsupported")

    def get(k, default=None, alt=()):
        for key in (k, *alt):
            if key in lac and lac[key] is not None:
                return lac[key]
            if key in d and d[key] is not None:
                return d[key]
        return default

    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    types = ["kda"] * n
    for i in full:
        types[i - 1] = "mla"
    return ModelConfig(
        name=name,
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=n, layer_types=tuple(types),
        rms_norm_eps=d.get("rms_norm_eps", 1e-5), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=get("max_position_embeddings", 1 << 20, ("model_max_length",)),
        bos_token_id=d.get("bos_token_id"), eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
        kda_num_heads=lac["num_heads"], kda_head_dim=lac["head_dim"],
        conv_kernel_size=lac.get("short_conv_kernel_size", 4),
        gate_lower_bound=get("gate_lower_bound"), kda_full_rank_gate=bool(get("use_full_rank_gate", False)),
        num_attention_heads=d["num_attention_heads"], q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        mla_output_gate=bool(d.get("mla_use_output_gate", False)),
        hidden_act=d.get("hidden_act", "silu"),
        situ_beta=float(d.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(d.get("activation_situ_linear_beta", 25.0)),
        first_k_dense_replace=d.get("first_k_dense_replace", 1), moe_layer_freq=d.get("moe_layer_freq", 1),
        intermediate_size=d.get("intermediate_size", 4 * d["hidden_size"]),
        num_experts=get("num_experts", 0, ("num_local_experts", "n_routed_experts")),
        num_experts_per_token=get("num_experts_per_token", 1, ("num_experts_per_tok",)),
        num_shared_experts=get("num_shared_experts", 0, ("n_shared_experts",)),
        moe_intermediate_size=d.get("moe_intermediate_size", 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(get("moe_renormalize", True, ("norm_topk_prob",))),
        num_expert_group=get("num_expert_group", 1, ("n_group",)), topk_group=d.get("topk_group") or 1,
        latent_size=d.get("routed_expert_hidden_size"), latent_norm=bool(d.get("latent_moe_use_norm", False)),
        attn_res_block_size=d.get("attn_res_block_size"),
        expert_quant=_expert_quant(d.get("quantization_config", raw.get("quantization_config")), name),
    )


MXFP4_FORMAT = "mxfp4-pack-quantized"


def mxfp4_quantization_config() -> dict:
    """The compressed-tensors block of a checkpoint whose routed experts are MXFP4 (as K3's)."""
    return {"quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
            "config_groups": {"group_0": {"format": MXFP4_FORMAT, "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                      "strategy": "group"}}}}


def _expert_quant(q, name: str) -> str | None:
    """None (bf16 checkpoint) or "mxfp4" from a config.json `quantization_config`; anything else is refused."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{name}: quantization_config must be a JSON object")
    formats = {q.get("format")} | {g.get("format") for g in (q.get("config_groups") or {}).values()
                                   if isinstance(g, dict)}
    formats.discard(None)
    if q.get("quant_method") == "compressed-tensors" and formats == {MXFP4_FORMAT}:
        for g in (q.get("config_groups") or {}).values():
            gs = (g.get("weights") or {}).get("group_size", 32) if isinstance(g, dict) else 32
            if gs != 32:
                raise ConfigError(f"{name}: MXFP4 group_size {gs} is not supported (expected 32)")
        return "mxfp4"
    raise ConfigError(f"{name}: quantization_config (quant_method {q.get('quant_method')!r}, formats "
                      f"{sorted(formats)}) is not supported; k3compile reads bf16 checkpoints and compressed-tensors "
                      f"'{MXFP4_FORMAT}' routed experts")


def _with_linear_attn_config(d: dict) -> dict:
    """transformers' KimiLinearConfig can be built from `layer_types` + `linear_num_heads` / `linear_head_dim`
    (its own serialization then has no `linear_attn_config`): rebuild the checkpoint-style block from them."""
    if d.get("linear_attn_config") is not None or not isinstance(d.get("layer_types"), list):
        return d
    kinds = d["layer_types"]
    unknown = sorted(set(kinds) - {"full_attention", "linear_attention"})
    if unknown:
        raise ConfigError(f"layer_types holds unknown kinds {unknown} (expected full_attention / linear_attention)")
    d = dict(d)
    d["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
        "num_heads": d.get("linear_num_heads"), "head_dim": d.get("linear_head_dim"),
        "short_conv_kernel_size": d.get("linear_conv_kernel_dim", 4),
    }
    return d


def read_config_json(path: str, what: str = "checkpoint") -> dict:
    """The parsed config.json of a checkpoint directory, or a ConfigError naming what is wrong."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{path}: not a {what} directory (no config.json)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None


def load_hf_config(path: str) -> ModelConfig:
    return config_from_hf_dict(read_config_json(path), name=os.path.basename(os.path.normpath(path)))
