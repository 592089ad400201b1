"""Config family: presets (spec §7), Hugging Face config I/O, and bad configs naming their problem."""
import copy
import json

import pytest
import torch

import k3compile
from k3compile.model_def.config import (PRESETS, ConfigError, ModelConfig, config_from_hf_dict, get_preset,
                                        load_hf_config)
from k3compile.model_def.loader import build_model


def param_formula(c: ModelConfig):
    """(total, active) parameter counts written out from the config fields, independent of the modules.
    Active excludes the embedding lookup and the routed experts that a token does not use (spec §7.2)."""
    D, K = c.hidden_size, c.kda_head_dim
    HK = c.kda_num_heads * K
    attn_res = c.attn_res_block_size is not None
    n = c.vocab_size * D * (1 if c.tie_word_embeddings else 2) + D + (2 * D if attn_res else 0)
    experts_all = experts_active = 0
    for i, kind in enumerate(c.layer_types):
        n += 2 * D + (4 * D if attn_res else 0)
        if kind == "kda":
            n += 3 * D * HK + 3 * HK * c.conv_kernel_size  # q/k/v projections and short convs
            n += D * K + K * HK + HK + c.kda_num_heads + D * c.kda_num_heads  # f_a, f_b, dt_bias, A_log, b_proj
            n += D * HK if c.kda_full_rank_gate else D * K + K * HK  # output gate
            n += K + HK * D  # o_norm, o_proj
        else:
            H, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
            n += D * H * qk if c.q_lora_rank is None else D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * qk
            n += D * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            n += c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
            n += (D * H * c.v_head_dim if c.mla_output_gate else 0) + H * c.v_head_dim * D
        if c.is_moe_layer(i):
            W = c.latent_size or D
            n += c.num_experts * D + 3 * D * c.moe_intermediate_size * c.num_shared_experts
            if c.latent_size:
                n += 2 * D * W + (W if c.latent_norm else 0)
            experts_all += c.num_experts * 3 * c.moe_intermediate_size * W
            experts_active += c.num_experts_per_token * 3 * c.moe_intermediate_size * W
        else:
            n += 3 * D * c.intermediate_size
    return n + experts_all, n + experts_active - c.vocab_size * D


def count(model):
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------- presets

@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta_and_matches_the_formula(name):
    cfg = get_preset(name)
    model = k3compile.load_model(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count(model) == param_formula(cfg)[0]
    assert [layer.kind for layer in model.model.layers] == list(cfg.layer_types)


# spec §7.1 / §7.2 totals and actives (the spec's own calculator)
@pytest.mark.parametrize("name,total,active", [
    ("k3", 2.779e12, 104.2e9), ("kimi-linear-48b", 49.1e9, 3.1e9), ("k3-mini-6b", 5.83e9, 1.62e9),
    ("k3-mini-3b", 3.18e9, 1.08e9), ("k3-tiny", 0.53e6, 0.35e6),
])
def test_preset_sizes_match_the_spec(name, total, active):
    t, a = param_formula(get_preset(name))
    assert t == pytest.approx(total, rel=5e-3)
    assert a == pytest.approx(active, rel=1e-2)


def test_k3_schedule_and_shapes():
    c = get_preset("k3")
    assert len(c.mla_layers) == 24 and len(c.kda_layers) == 69
    assert [i + 1 for i in c.mla_layers] == list(range(4, 93, 4)) + [93]
    assert c.kv_cache_width == 576 and c.qk_head_dim == 192
    assert sum(c.is_moe_layer(i) for i in range(93)) == 92 and not c.is_moe_layer(0)


def test_k3_tiny_is_the_spec_table():
    c = get_preset("k3-tiny")
    assert [i + 1 for i in c.mla_layers] == [4, 8, 9]
    assert (c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.q_lora_rank, c.kv_lora_rank) == (64, 2, 16, 32, 16)
    assert (c.num_experts, c.num_experts_per_token, c.latent_size, c.num_shared_experts) == (8, 2, 32, 2)
    assert (c.gate_lower_bound, c.hidden_act, c.situ_beta, c.situ_linear_beta) == (-5.0, "situ", 4.0, 25.0)
    assert c.attn_res_block_size == 4 and c.latent_norm and c.kda_full_rank_gate and c.mla_output_gate
    assert count(build_model(c, device="meta")) == pytest.approx(0.53e6, rel=5e-3)


def test_kimi_linear_tiny_is_consistent_with_its_config():
    c = get_preset("kimi-linear-tiny")
    model = build_model(c, device="meta")
    assert count(model) == param_formula(c)[0]
    m = model.model
    assert not hasattr(m, "output_attn_res_proj")
    for i, layer in enumerate(m.layers):
        assert not hasattr(layer, "self_attention_res_proj")
        assert hasattr(layer, "mlp") == (i == 0) and hasattr(layer, "block_sparse_moe") == (i > 0)
        attn = layer.self_attn
        if c.layer_types[i] == "kda":  # softplus gate, low-rank output gate
            assert hasattr(attn, "g_a_proj") and not hasattr(attn, "g_proj") and attn.lower_bound is None
            assert attn.A_log.shape == (c.kda_num_heads,)
        else:  # no q-LoRA, no output gate
            assert hasattr(attn, "q_proj") and not hasattr(attn, "q_a_proj") and not hasattr(attn, "g_proj")
        if i > 0:
            moe = layer.block_sparse_moe
            assert not hasattr(moe, "routed_expert_down_proj")
            assert moe.experts.w13.shape == (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
            assert moe.gate.scaling == pytest.approx(2.446)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match="k4-tiny.*k3-tiny"):
        get_preset("k4-tiny")


# ------------------------------------------------------------------------------------- HF I/O

@pytest.mark.parametrize("name", list(PRESETS))
def test_hf_dict_round_trip(name):
    cfg = get_preset(name)
    raw = json.loads(json.dumps(cfg.to_hf_dict()))  # must be plain JSON
    assert config_from_hf_dict(raw, name=cfg.name) == cfg


def test_k3_outer_config_with_text_config(tmp_path):
    cfg = get_preset("k3-tiny")
    outer = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
             "text_config": cfg.to_hf_dict(), "vision_config": {"patch_size": 14, "num_hidden_layers": 2},
             "media_placeholder_token_id": 300}
    assert config_from_hf_dict(outer, name="k3-tiny") == cfg
    (tmp_path / "config.json").write_text(json.dumps(outer))
    assert load_hf_config(str(tmp_path)) == cfg.replace(name=tmp_path.name)


def _hf_kimi_linear_config(**kw):
    from transformers import KimiLinearConfig

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                v_head_dim=16, qk_nope_head_dim=16, num_experts=8, num_experts_per_token=3, num_shared_experts=2,
                num_expert_group=4, topk_group=2, routed_scaling_factor=1.5, first_k_dense_replace=2,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 3,
                                    "full_attn_layers": [2, 5], "kda_layers": [1, 3, 4]})
    base.update(kw)
    return KimiLinearConfig(**base)


def test_transformers_config_to_dict_parses():
    hf = _hf_kimi_linear_config()
    c = config_from_hf_dict(json.loads(hf.to_json_string()))
    assert c.layer_types == ("kda", "mla", "kda", "kda", "mla")
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size) == (4, 8, 3)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (24, 16, 16, 8, 16)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (8, 3, 2)
    assert (c.num_expert_group, c.topk_group, c.first_k_dense_replace) == (4, 2, 2)
    assert (c.routed_scaling_factor, c.rms_norm_eps, c.hidden_act, c.moe_renormalize) == (1.5, 1e-6, "silu", True)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.vocab_size) == (1, 2, 0, 96)
    assert c.gate_lower_bound is None and c.attn_res_block_size is None and not c.is_k3


def test_transformers_config_without_linear_attn_config_parses():
    from transformers import KimiLinearConfig

    hf = KimiLinearConfig(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                          linear_num_heads=2, linear_head_dim=8,
                          layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    c = config_from_hf_dict(json.loads(hf.to_json_string()))
    assert c.layer_types == ("kda", "kda", "kda", "mla") and (c.kda_num_heads, c.kda_head_dim) == (2, 8)


# ----------------------------------------------------------------------------------- bad configs

def _good():
    return get_preset("kimi-linear-tiny").to_hf_dict()


def _bad(edit):
    d = copy.deepcopy(_good())
    edit(d)
    return d


BAD = {
    "unknown model_type": (lambda d: d.update(model_type="llama"), "model_type 'llama'"),
    "missing field": (lambda d: d.pop("kv_lora_rank"), "missing required field.*kv_lora_rank"),
    "missing linear_attn_config key": (lambda d: d["linear_attn_config"].pop("num_heads"), "num_heads"),
    "overlapping layers": (lambda d: d["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5]),
                           r"\[4\].*both.*full_attn_layers.*kda_layers"),
    "non-covering layers": (lambda d: d["linear_attn_config"].update(kda_layers=[1, 2, 3]),
                            r"must cover layers 1\.\.6"),
    "layer out of range": (lambda d: d["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 7]), "cover"),
    "top-k above experts": (lambda d: d.update(num_experts_per_token=9), "num_experts_per_token = 9"),
    "kv heads": (lambda d: d.update(num_key_value_heads=1), r"num_key_value_heads \(1\)"),
    "gate bound too low": (lambda d: d["linear_attn_config"].update(gate_lower_bound=-6.0), "gate_lower_bound"),
    "gate bound positive": (lambda d: d["linear_attn_config"].update(gate_lower_bound=0.5), "gate_lower_bound"),
    "gate bound zero": (lambda d: d["linear_attn_config"].update(gate_lower_bound=0.0), "gate_lower_bound"),
    "unknown activation": (lambda d: d.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    "rotary MLA": (lambda d: d.update(mla_use_nope=False), "mla_use_nope"),
    "softmax router": (lambda d: d.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    "groups do not divide": (lambda d: d.update(num_expert_group=3), r"num_expert_group \(3\)"),
    "topk_group above groups": (lambda d: d.update(num_expert_group=2, topk_group=3), r"topk_group \(3\)"),
    "zero hidden size": (lambda d: d.update(hidden_size=0), "hidden_size must be > 0"),
    "latent norm without latent": (lambda d: d.update(latent_moe_use_norm=True), "routed_expert_hidden_size"),
    "bad block size": (lambda d: d.update(attn_res_block_size=0), "attn_res_block_size"),
    "text_config not an object": (lambda d: d.update(text_config=[1, 2]), "text_config"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_names_the_field(case):
    edit, pattern = BAD[case]
    with pytest.raises(ConfigError, match=pattern):
        config_from_hf_dict(_bad(edit), name="ckpt")


def test_config_json_not_an_object():
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_hf_dict([1, 2, 3])


def test_non_json_config_file(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 512,')
    with pytest.raises(ConfigError, match="config.json.*not valid JSON"):
        load_hf_config(str(tmp_path))
    with pytest.raises(ConfigError, match="not valid JSON"):
        k3compile.load_model(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize("kw,pattern", [
    (dict(layer_types=("kda", "mla")), "2 entries but num_hidden_layers = 9"),
    (dict(layer_types=("kda",) * 8 + ("gdn",)), r"unknown layer kinds \['gdn'\]"),
    (dict(num_experts_per_token=0), "num_experts_per_token = 0"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(latent_size=-1), "routed_expert_hidden_size"),
])
def test_model_config_validation(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        get_preset("k3-tiny").replace(**kw)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        get_preset("nope")


def test_meta_only_presets_refuse_real_devices():
    with pytest.raises(ConfigError, match="device='meta'"):
        k3compile.load_model("kimi-linear-48b")
    assert next(k3compile.load_model("kimi-linear-48b", device="meta").parameters()).device == torch.device("meta")


def test_top_k_larger_than_group_limited_experts_is_rejected():
    d = _good()
    d.update(num_experts=8, num_expert_group=4, topk_group=1, num_experts_per_token=3)
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        config_from_hf_dict(d)
