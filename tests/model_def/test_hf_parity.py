"""Parity with transformers' KimiLinearForCausalLM (its pure-torch KDA fallback; fla is not installed on CPU).

Random tiny configs are built with transformers, their weights re-drawn at a scale where every block
moves the logits (norm weights and router biases too), saved with `save_pretrained`, loaded with
`k3compile.load_model`, and compared in fp32. Then our writer's output must load back into transformers.
"""
import pytest
import torch

import k3compile
from k3compile.model_def.checkpoint import save_checkpoint
from k3compile.model_def.ops.moe_math import route

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

VOCAB = 96
TOL = dict(atol=1e-4, rtol=0)


def hf_config(full, n_layers, q_lora=None, experts=4, top_k=2, shared=1, inter=16, kda_heads=2, kda_dim=8, conv=4,
              **kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=inter,
                num_hidden_layers=n_layers, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                q_lora_rank=q_lora, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts=experts,
                num_experts_per_token=top_k, num_shared_experts=shared, first_k_dense_replace=1,
                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                linear_attn_config={"head_dim": kda_dim, "num_heads": kda_heads, "short_conv_kernel_size": conv,
                                    "full_attn_layers": full,
                                    "kda_layers": [i for i in range(1, n_layers + 1) if i not in full]})
    base.update(kw)
    return KimiLinearConfig(**base)


@torch.no_grad()
def randomize(model, seed):
    """Weights at fan-in scale (so deep layers matter at 1e-4), norms ~ 1 + N(0, 0.2), router bias ~ N(0, 0.1).
    The KDA gate parameters (A_log, dt_bias) and conv weights keep transformers' own random init."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or "layernorm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(("A_log", "dt_bias", "conv1d.weight")):
            continue
        elif p.dim() >= 2 and p.numel():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.copy_(0.1 * torch.randn(mod.e_score_correction_bias.shape, generator=g))


CONFIGS = {
    # MLA only at the last layer, no q-LoRA
    "mla_last": dict(full=[4], n_layers=4),
    # two MLA layers in a row (3, 4) then KDA, q-LoRA on, 8 experts top-3, 2 shared, narrow experts
    "mla_pair_qlora": dict(full=[3, 4], n_layers=5, q_lora=24, experts=8, top_k=3, shared=2, inter=8),
    # top-1 routing, MLA at 2 and 5, wider KDA heads
    "top1": dict(full=[2, 5], n_layers=5, experts=6, top_k=1, kda_heads=4, kda_dim=8),
    # group-limited routing: 16 experts in 4 groups, keep 2 groups, top-4; no renormalization
    "grouped": dict(full=[3], n_layers=3, experts=16, top_k=4, num_expert_group=4, topk_group=2,
                    moe_renormalize=False, routed_scaling_factor=1.7),
    # two dense layers before the MoE ones, shorter conv kernel, MLA first
    "dense2_conv3": dict(full=[1, 4], n_layers=4, q_lora=16, experts=4, top_k=4, first_k_dense_replace=2, conv=3),
}


def _make(name, tmp_path_factory):
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hf_config(**CONFIGS[name])).eval()
    randomize(hf, seed=len(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    hf, path = _make(request.param, tmp_path_factory)
    ours = k3compile.load_model(str(path), progress=False)
    return request.param, hf, ours, path


def ids_for(batch, length, seed):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [37, 100])  # not a multiple of 64; longer than one 64-token KDA chunk
def test_logits_match_transformers(pair, length):
    name, hf, ours, _ = pair
    ids = ids_for(2, length, seed=length)
    with torch.no_grad():
        ref = hf(ids).logits
    out = ours(ids)
    assert out.shape == ref.shape == (2, length, VOCAB)
    assert ref.abs().max() > 1.0  # the scale at which a 1e-4 match means something
    torch.testing.assert_close(out, ref, **TOL)


def test_config_read_from_the_checkpoint(pair):
    name, hf, ours, _ = pair
    c, h = ours.config, hf.config
    assert [t == "mla" for t in c.layer_types] == [t == "full_attention" for t in h.layer_types]
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (
        h.num_local_experts, h.num_experts_per_tok, h.n_shared_experts)
    assert (c.num_expert_group, c.topk_group, c.q_lora_rank) == (h.n_group, h.topk_group, h.q_lora_rank)
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size) == (
        h.linear_num_heads, h.linear_head_dim, h.linear_conv_kernel_dim)
    assert [i for i in range(c.num_hidden_layers) if not c.is_moe_layer(i)] == [
        i for i, t in enumerate(h.mlp_layer_types) if t == "dense"]


def test_group_limiting_is_exercised():
    """In the grouped config, limiting to 2 of 4 groups changes the choice for some tokens,
    so the parity above covers the group rule and not only plain top-k."""
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hf_config(**CONFIGS["grouped"])).eval()
    randomize(hf, seed=len("grouped"))
    router = hf.model.layers[1].mlp.gate
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, _, ids_hf = router(x)
    logits = x @ router.weight.T
    _, ids_plain = route(logits, router.e_score_correction_bias, 4, False, 1.7)
    _, ids_grouped = route(logits, router.e_score_correction_bias, 4, False, 1.7, 4, 2)
    assert torch.equal(ids_grouped.sort(-1).values, ids_hf.sort(-1).values)
    assert not torch.equal(ids_plain.sort(-1).values, ids_grouped.sort(-1).values)


def test_round_trip_through_our_writer(pair, tmp_path):
    """save_checkpoint output loads into transformers with no missing / unexpected tensors, same logits."""
    name, hf, ours, _ = pair
    save_checkpoint(ours, str(tmp_path))
    back, info = KimiLinearForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    back.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref_state, back_state = hf.state_dict(), back.state_dict()
    assert ref_state.keys() == back_state.keys()
    for k in ref_state:
        assert torch.equal(ref_state[k], back_state[k]), k
    ids = ids_for(1, 45, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)
    # and our own loader reads our own output back to the same model
    torch.testing.assert_close(k3compile.load_model(str(tmp_path), progress=False)(ids), ours(ids), atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_zero_shared_experts_loads(tmp_path):
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hf_config(full=[2], n_layers=2, shared=0)).eval()
    randomize(hf, seed=5)
    hf.save_pretrained(tmp_path)
    ours = k3compile.load_model(str(tmp_path), progress=False)
    ids = ids_for(1, 9, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **TOL)
