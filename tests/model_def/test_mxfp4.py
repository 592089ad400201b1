"""MXFP4 experts: the dequantization reference against hand-computed values, the quantizer, the
config and checkpoint round trip (compressed-tensors names), malformed checkpoints, and the
reference MoE on dequantized weights."""
import functools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3compile.model_def.checkpoint import save_checkpoint
from k3compile.model_def.checkpoint_errors import CheckpointError
from k3compile.model_def.config import ConfigError, ModelConfig, get_preset
from k3compile.model_def.init import init_random
from k3compile.model_def.loader import build_model, load_model
from k3compile.model_def.ops import mxfp4
from k3compile.model_def.ops.moe_math import moe_experts_loop


def test_e2m1_table_by_hand():
    # code = s eee m with 2 exponent bits: 0b0001 = 0.5 (subnormal), 0b0010 = 1.0, 0b0111 = 1.5 * 2^2 = 6
    assert mxfp4.e2m1_table().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_dequantize_by_hand():
    codes = torch.tensor([[0x1, 0x7, 0x9, 0xF] + [0] * 28,  # 0.5, 6, -0.5, -6 then zeros
                          [0x2, 0xA, 0x5, 0xD] + [0x4] * 28], dtype=torch.uint8)
    packed = mxfp4.pack_codes(codes)
    assert packed.shape == (2, 16) and packed[0, 0] == 0x71 and packed[0, 1] == 0xF9  # low nibble first
    scale = torch.tensor([[127], [130]], dtype=torch.uint8)  # 2^0 and 2^3
    w = mxfp4.dequantize(packed, scale)
    assert w[0, :4].tolist() == [0.5, 6.0, -0.5, -6.0] and w[0, 4:].abs().sum() == 0
    assert w[1, :4].tolist() == [8.0, -8.0, 24.0, -24.0] and (w[1, 4:] == 16.0).all()
    tiny = mxfp4.dequantize(packed[:1], torch.tensor([[0]], dtype=torch.uint8))  # 2^-127: still exact in fp32
    assert tiny[0, 0].item() == 0.5 * 2.0 ** -127
    assert torch.equal(mxfp4.unpack_codes(packed), codes)
    assert mxfp4.dequantize(packed, scale, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 64, generator=gen)
    packed, scale = mxfp4.quantize(w)
    assert packed.shape == (3, 5, 32) and scale.shape == (3, 5, 2)
    back = mxfp4.dequantize(packed, scale)
    # values already on the grid come back exactly (the codes may differ: a smaller scale can fit them);
    # everything else lands within the group's largest E2M1 step
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(back)), back)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, -1)  # largest E2M1 gap is 2 * 2^(e-127)
    assert ((back - w).abs() <= step + 1e-7).all()
    assert (w.view(3, 5, 2, 32).abs().amax(-1) / torch.exp2(scale.float() - 127) <= 6.0).all()  # no group clips
    assert mxfp4.quantize(torch.zeros(1, 32))[1].item() == 0


@pytest.mark.parametrize("packed,scale,message", [
    (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), "packed codes must be uint8"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1), "E8M0 scales must be uint8"),
    (torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "not a multiple of the group size"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "scales have shape \\[2, 2\\]"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 255, dtype=torch.uint8), "255 \\(NaN\\)"),
])
def test_malformed_mxfp4_tensors(packed, scale, message):
    with pytest.raises(mxfp4.MXFP4FormatError, match=message):
        mxfp4.dequantize(packed, scale)


# ----------------------------------------------------------------------------- model + checkpoint

@functools.lru_cache(maxsize=None)
def _quantized_model():
    cfg = get_preset("k3-tiny").replace(name="k3-tiny-mxfp4", num_hidden_layers=3, layer_types=("kda", "mla", "kda"),
                                        attn_res_block_size=None, expert_quant="mxfp4")
    m = build_model(cfg)
    init_random(m, 0)
    return m


def test_config_round_trip_and_refusals():
    cfg = _quantized_model().config
    d = cfg.to_hf_dict()
    assert d["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert ModelConfig.from_hf_dict(d, name=cfg.name) == cfg
    assert ModelConfig.from_hf_dict(get_preset("k3-tiny").to_hf_dict()).expert_quant is None
    other = dict(d, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match="quant_method 'fp8'.*not supported"):
        ModelConfig.from_hf_dict(other)
    with pytest.raises(ConfigError, match="divisible by the group size 32"):
        get_preset("k3-tiny").replace(moe_intermediate_size=48, expert_quant="mxfp4")


def test_experts_are_stored_packed_and_run_on_dequantized_weights():
    m = _quantized_model()
    experts = m.model.layers[1].block_sparse_moe.experts
    assert experts.w13_packed.dtype == torch.uint8 and experts.w13_packed.shape == (8, 64, 16)
    assert experts.w2_scale.shape == (8, 32, 1)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(5, 32, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)])
    wts = torch.rand(5, 2, generator=gen)
    want = moe_experts_loop(z, ids, wts, mxfp4.dequantize(experts.w13_packed, experts.w13_scale),
                            mxfp4.dequantize(experts.w2_packed, experts.w2_scale), "situ", 4.0, 25.0)
    assert torch.equal(experts(z, wts, ids), want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mxfp4") / "ckpt")
    save_checkpoint(_quantized_model(), path)
    return path


def test_checkpoint_uses_compressed_tensors_names_and_loads_back(saved):
    tensors = load_file(os.path.join(saved, "model.safetensors"))
    prefix = "model.layers.1.block_sparse_moe.experts.3"
    assert tensors[f"{prefix}.w1.weight_packed"].shape == (32, 16)  # [I, D/2]
    assert tensors[f"{prefix}.w3.weight_scale"].shape == (32, 1)  # [I, D/32]
    assert tensors[f"{prefix}.w2.weight_packed"].dtype == torch.uint8
    assert not any(k.endswith("experts.3.w1.weight") for k in tensors)
    m = _quantized_model()
    loaded = load_model(saved, progress=False)
    assert loaded.config.expert_quant == "mxfp4"
    for (name, a), (_, b) in zip(sorted(m.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    x = torch.randint(0, 500, (1, 6))
    assert torch.equal(loaded(x), m(x))


def _rewrite(saved, tmp_path, edit):
    dst = tmp_path / "bad"
    dst.mkdir()
    for f in os.listdir(saved):
        if f != "model.safetensors":
            (dst / f).write_bytes(open(os.path.join(saved, f), "rb").read())
    tensors = load_file(os.path.join(saved, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


KEY = "model.layers.1.block_sparse_moe.experts.0"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.__setitem__(f"{KEY}.w1.weight_scale", torch.full((32, 1), 255, dtype=torch.uint8)),
     "w1.weight_scale.*255 \\(NaN\\)"),
    (lambda t: t.__setitem__(f"{KEY}.w1.weight_scale", torch.zeros(32, 2, dtype=torch.uint8)),
     "w1.weight_scale.*has shape \\[32, 2\\], expected \\[32, 1\\]"),
    (lambda t: t.__setitem__(f"{KEY}.w2.weight_packed", torch.zeros(32, 16)),
     "w2.weight_packed.*is torch.float32; MXFP4 expert codes and scales must be uint8"),
    (lambda t: t.pop(f"{KEY}.w3.weight_scale"), "missing tensor.*w3.weight_scale"),
])
def test_malformed_checkpoints_name_the_tensor(saved, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(_rewrite(saved, tmp_path, edit), progress=False)


def test_bf16_checkpoint_into_an_mxfp4_config_is_refused(saved, tmp_path):
    def dense(t):
        t.pop(f"{KEY}.w1.weight_packed")
        t[f"{KEY}.w1.weight"] = torch.zeros(32, 32)
    with pytest.raises(CheckpointError, match="unexpected tensor.*w1.weight'"):
        load_model(_rewrite(saved, tmp_path, dense), progress=False)
    assert json.load(open(os.path.join(saved, "config.json")))["quantization_config"]["quant_method"] == \
        "compressed-tensors"
