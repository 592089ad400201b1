"""Checkpoint I/O: round trips, sharding, the on-disk names (spec §1.2, §3.2, §4.2), layout variants
the real checkpoints use, and errors that name the tensor or file. Pickle files are never opened."""
import json
import os
import pickle

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import k3compile
from k3compile.model_def.checkpoint import INDEX_FILE, checkpoint_targets, load_weights, save_checkpoint
from k3compile.model_def.checkpoint_errors import CheckpointError
from k3compile.model_def.config import ConfigError
from k3compile.model_def.loader import build_model

IDS = torch.tensor([[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]])


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def saved(request, tmp_path_factory):
    """(model, directory holding its single-file checkpoint, reference logits)."""
    model = k3compile.load_model(request.param, seed=21)
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(model, str(path))
    return model, str(path), model(IDS)


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    model = k3compile.load_model("k3-tiny", seed=22)
    path = tmp_path_factory.mktemp("k3")
    save_checkpoint(model, str(path))
    return str(path), model(IDS)


def tensors_of(path):
    return load_file(os.path.join(path, "model.safetensors"))


def write_variant(src, dst, edit_tensors=None, edit_config=None):
    """Copy a single-file checkpoint to dst, editing its tensor dict and/or config dict on the way."""
    os.makedirs(dst, exist_ok=True)
    tensors = tensors_of(src)
    if edit_tensors:
        tensors = edit_tensors(tensors) or tensors
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        cfg = edit_config(cfg) or cfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def without(name):
    def edit(t):
        del t[name]
    return edit


def load(path):
    return k3compile.load_model(path, progress=False)


# ------------------------------------------------------------------------------------ round trips

def test_save_load_round_trip(saved):
    model, path, ref = saved
    back = load(path)
    assert back.config == model.config.replace(name=os.path.basename(path))
    torch.testing.assert_close(back(IDS), ref, atol=0, rtol=0)
    for (n, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), n


def test_sharded_save_writes_an_index_and_loads(saved, tmp_path):
    model, _, ref = saved
    save_checkpoint(model, str(tmp_path), max_shard_bytes=64 * 1024)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) > 3 and "model.safetensors" not in shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with open(tmp_path / INDEX_FILE) as f:
        index = json.load(f)
    on_disk = {}
    for fn in shards:
        with safe_open(str(tmp_path / fn), "pt") as h:
            on_disk.update({k: fn for k in h.keys()})
    assert index["weight_map"] == on_disk
    assert set(on_disk) == set(checkpoint_targets(model))
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.state_dict().values())
    torch.testing.assert_close(load(str(tmp_path))(IDS), ref, atol=0, rtol=0)


def test_bf16_model_saves_bf16_and_loads_into_fp32(tmp_path):
    model = k3compile.load_model("k3-tiny", seed=23, dtype=torch.bfloat16)
    save_checkpoint(model, str(tmp_path))
    t = tensors_of(str(tmp_path))
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    back = k3compile.load_model(str(tmp_path), progress=False)
    assert back.lm_head.weight.dtype == torch.float32
    assert torch.equal(back.lm_head.weight, model.lm_head.weight.float())


# ----------------------------------------------------------------------------------------- names

K3_NAMES = [  # spec §1.2 (KDA), §2.3 (MLA), §3.2 (AttnRes), §4.2 (Stable LatentMoE); k3-tiny: MLA at 3, 7, 8
    "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
    "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight",
    "model.layers.0.mlp_res_proj.weight", "model.layers.0.mlp_res_norm.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
    *[f"model.layers.1.self_attn.{n}" for n in (
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
        "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log", "b_proj.weight", "g_proj.weight",
        "o_norm.weight", "o_proj.weight")],
    *[f"model.layers.3.self_attn.{n}" for n in (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "g_proj.weight", "o_proj.weight")],
    *[f"model.layers.1.block_sparse_moe.{n}" for n in (
        "gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight", "routed_expert_norm.weight",
        "routed_expert_up_proj.weight", "experts.3.w1.weight", "experts.3.w2.weight", "experts.3.w3.weight",
        "experts.7.w2.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight")],
]


def test_k3_checkpoint_names(k3_dir):
    path, _ = k3_dir
    t = tensors_of(path)
    missing = [n for n in K3_NAMES if n not in t]
    assert not missing
    # stacked in-memory expert tensors never reach the disk; neither do low-rank gates K3 does not have
    assert not [n for n in t if n.endswith((".w13", ".experts.w2")) or "g_a_proj" in n]
    assert "model.layers.3.self_attn.q_proj.weight" not in t  # MLA with q-LoRA
    c = k3compile.get_preset("k3-tiny")
    hk, I, L, D = c.kda_dim, c.moe_intermediate_size, c.latent_size, c.hidden_size
    assert t["model.layers.1.self_attn.q_conv1d.weight"].shape == (hk, 1, c.conv_kernel_size)
    assert t["model.layers.1.self_attn.A_log"].shape == (c.kda_num_heads,)  # K3 keeps A_log per head
    assert t["model.layers.1.self_attn.g_proj.weight"].shape == (hk, D)  # full-rank output gate
    assert t["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (I, L)  # experts live in the latent
    assert t["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (L, I)
    assert t["model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"].shape == (L, D)
    assert t["model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"].shape == (2 * I, D)
    assert t["model.layers.8.self_attention_res_proj.weight"].shape == (1, D)
    assert sum(".experts." in n for n in t) == 8 * 3 * 8  # 8 MoE layers x 8 experts x w1/w2/w3


def test_kimi_linear_checkpoint_names(tmp_path):
    save_checkpoint(k3compile.load_model("kimi-linear-tiny"), str(tmp_path))
    t = tensors_of(str(tmp_path))
    assert t["model.layers.0.self_attn.A_log"].shape == (1, 1, 2, 1)  # transformers' layout
    for n in ("g_a_proj.weight", "g_b_proj.weight", "q_conv1d.weight"):
        assert f"model.layers.0.self_attn.{n}" in t
    assert "model.layers.3.self_attn.q_proj.weight" in t
    assert not [n for n in t if "attn_res" in n or "res_proj" in n or "routed_expert" in n]


def test_expert_weights_land_in_the_right_rows(k3_dir, tmp_path):
    """w1 fills the gate half of the stacked w13, w3 the up half, w2 the down weight, per expert index."""
    path, _ = k3_dir
    t = tensors_of(path)
    model = load(path)
    exp = model.model.layers[2].block_sparse_moe.experts
    I = exp.w2.shape[2]
    for e in (0, 5):
        p = f"model.layers.2.block_sparse_moe.experts.{e}"
        assert torch.equal(exp.w13[e, :I], t[f"{p}.w1.weight"])
        assert torch.equal(exp.w13[e, I:], t[f"{p}.w3.weight"])
        assert torch.equal(exp.w2[e], t[f"{p}.w2.weight"])


# -------------------------------------------------------------------------------- layout variants

@pytest.mark.parametrize("layout", ["hf_4d", "padded_128_style", "flat"])
def test_a_log_layouts(k3_dir, tmp_path, layout):
    path, ref = k3_dir

    def edit(t):
        for n in [n for n in t if n.endswith("A_log")]:
            h = t[n].numel()
            if layout == "hf_4d":
                t[n] = t[n].view(1, 1, h, 1)
            elif layout == "padded_128_style":  # K3 stores 128 entries, zeros past H
                t[n] = torch.cat([t[n].flatten(), torch.zeros(6)])
    out = write_variant(path, tmp_path / "v", edit)
    torch.testing.assert_close(load(out)(IDS), ref, atol=0, rtol=0)


def test_a_log_padding_must_be_zero(k3_dir, tmp_path):
    path, _ = k3_dir

    def edit(t):
        t["model.layers.2.self_attn.A_log"] = torch.cat([t["model.layers.2.self_attn.A_log"], torch.ones(6)])
    out = write_variant(path, tmp_path / "v", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.A_log.*\[8\]"):
        load(out)


def test_language_model_prefix_and_vision_tower(k3_dir, tmp_path):
    """K3's multimodal layout: decoder under `language_model.`, config under `text_config`, a vision tower."""
    path, ref = k3_dir

    def edit_t(t):
        t = {f"language_model.{k}": v for k, v in t.items()}
        t["vision_tower.encoder.blocks.0.attn.qkv.weight"] = torch.randn(96, 32)
        t["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 14, 14)
        t["multi_modal_projector.linear_1.weight"] = torch.randn(64, 128)
        return t

    def edit_c(c):
        return {"model_type": "kimi_k3", "text_config": c, "vision_config": {"patch_size": 14}}
    out = write_variant(path, tmp_path / "v", edit_t, edit_c)
    torch.testing.assert_close(load(out)(IDS), ref, atol=0, rtol=0)


def test_hf_dense_layer_name_is_accepted(saved, tmp_path):
    """transformers' save_pretrained writes the dense layer-0 MLP as block_sparse_moe.{gate,up,down}_proj."""
    model, path, ref = saved

    def edit(t):
        return {k.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): v for k, v in t.items()}
    out = write_variant(path, tmp_path / "v", edit)
    torch.testing.assert_close(load(out)(IDS), ref, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------- errors

def test_missing_tensor(k3_dir, tmp_path):
    path, _ = k3_dir
    out = write_variant(path, tmp_path / "v", without("model.layers.4.self_attn.dt_bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.4\.self_attn\.dt_bias"):
        load(out)


def test_missing_expert(k3_dir, tmp_path):
    path, _ = k3_dir
    out = write_variant(path, tmp_path / "v", without("model.layers.5.block_sparse_moe.experts.6.w3.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.5\.block_sparse_moe\.experts\.6\.w3\.weight"):
        load(out)


@pytest.mark.parametrize("name,shape", [
    ("model.layers.3.self_attn.kv_b_proj.weight", (64, 17)),
    ("model.layers.1.block_sparse_moe.experts.2.w1.weight", (32, 64)),
    ("model.norm.weight", (65,)),
])
def test_wrong_shape(k3_dir, tmp_path, name, shape):
    path, _ = k3_dir

    def edit(t):
        t[name] = torch.zeros(shape)
    out = write_variant(path, tmp_path / "v", edit)
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}.*model\.safetensors.*shape"):
        load(out)


def test_unexpected_tensor(k3_dir, tmp_path):
    path, _ = k3_dir

    def edit(t):
        t["model.layers.2.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    out = write_variant(path, tmp_path / "v", edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.self_attn\.rotary_emb\.inv_freq'"):
        load(out)


def test_duplicate_tensor_across_shards(k3_dir, tmp_path):
    path, _ = k3_dir
    t = tensors_of(path)
    names = sorted(t)
    save_file({n: t[n] for n in names[:10]}, str(tmp_path / "a.safetensors"))
    save_file({n: t[n] for n in names[9:]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(CheckpointError, match=rf"'{names[9]}' appears twice.*b\.safetensors"):
        load(str(tmp_path))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any attempt to unpickle fails the test loudly."""
    def refuse(*a, **k):
        raise AssertionError("a pickle file was opened")
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


@pytest.mark.parametrize("fname", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_only_directory_is_refused_unopened(k3_dir, tmp_path, no_unpickling, fname):
    path, _ = k3_dir
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    # a real pickle payload: opening it would run code (here it would only print)
    (tmp_path / fname).write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(CheckpointError, match=rf"{fname}.*never unpickles"):
        load(str(tmp_path))


def test_pickle_next_to_safetensors_is_ignored(k3_dir, tmp_path, no_unpickling):
    path, ref = k3_dir
    out = write_variant(path, tmp_path / "v")
    (tmp_path / "v" / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    torch.testing.assert_close(load(out)(IDS), ref, atol=0, rtol=0)


def test_no_weights_at_all(k3_dir, tmp_path):
    path, _ = k3_dir
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(CheckpointError, match="no \\*\\.safetensors"):
        load(str(tmp_path))


def test_corrupt_safetensors_garbage(k3_dir, tmp_path):
    path, _ = k3_dir
    out = write_variant(path, tmp_path / "v")
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"\x00\x01this is not a safetensors file" * 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*not a readable safetensors"):
        load(out)


def test_corrupt_safetensors_truncated(k3_dir, tmp_path):
    path, _ = k3_dir
    out = write_variant(path, tmp_path / "v")
    fn = os.path.join(out, "model.safetensors")
    data = open(fn, "rb").read()
    with open(fn, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(out)


def _sharded(k3_dir, tmp_path):
    path, _ = k3_dir
    save_checkpoint(load(path), str(tmp_path), max_shard_bytes=128 * 1024)
    return tmp_path


@pytest.mark.parametrize("content", [
    '{"weight_map": ', '{"metadata": {}}', "[]",
    '{"weight_map": [1, 2]}', '{"weight_map": {"lm_head.weight": 7}}',
])
def test_malformed_index(k3_dir, tmp_path, content):
    d = _sharded(k3_dir, tmp_path)
    (d / INDEX_FILE).write_text(content)
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}.*malformed"):
        load(str(d))


def test_index_names_a_missing_shard(k3_dir, tmp_path):
    d = _sharded(k3_dir, tmp_path)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[1]
    os.remove(d / shard)
    with pytest.raises(CheckpointError, match=rf"lists shard '{shard}'.*does not exist"):
        load(str(d))


def test_load_weights_into_a_model_of_another_shape(k3_dir):
    path, _ = k3_dir
    other = build_model(k3compile.get_preset("k3-tiny").replace(kv_lora_rank=8))
    with pytest.raises(CheckpointError, match="shape"):
        load_weights(other, path, progress=False)


# ------------------------------------------------------------------------------------ load_model

def test_full_size_preset_is_meta_only():
    with pytest.raises(ConfigError, match="'k3'.*meta"):
        k3compile.load_model("k3")
    model = k3compile.load_model("k3", device="meta")
    assert model.lm_head.weight.is_meta and model.config.num_experts == 896


def test_unknown_name():
    with pytest.raises(ConfigError, match="unknown model 'no-such-model'"):
        k3compile.load_model("no-such-model")


def test_a_file_is_not_a_checkpoint(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="expected a checkpoint directory"):
        k3compile.load_model(str(f))


def test_presets_are_deterministic():
    a = k3compile.load_model("k3-tiny", seed=4)
    b = k3compile.load_model("k3-tiny", seed=4)
    c = k3compile.load_model("k3-tiny", seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
