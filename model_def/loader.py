"""`load_model(name_or_path)`: a preset with deterministic random weights, or a checkpoint directory."""
from __future__ import annotations

import os

import torch

from .checkpoint import load_weights
from .checkpoint_errors import CheckpointError
from .config import META_ONLY_PRESETS, PRESETS, ConfigError, ModelConfig, get_preset, load_hf_config
from .init import init_random
from .model import K3ForCausalLM


def resolve_config(name_or_path: str) -> ModelConfig:
    if name_or_path in PRESETS:
        return get_preset(name_or_path)
    if os.path.isdir(name_or_path):
        return load_hf_config(name_or_path)
    if os.path.exists(name_or_path):
        raise CheckpointError(f"{name_or_path}: expected a checkpoint directory (config.json + *.safetensors), "
                              f"got a file")
    raise ConfigError(f"unknown model '{name_or_path}': not a preset ({', '.join(PRESETS)}) "
                      f"and not a checkpoint directory")


def build_model(cfg: ModelConfig, dtype=torch.float32, device="cpu") -> K3ForCausalLM:
    """Instantiate on the meta device, then materialize uninitialized storage on `device`."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model = model.to(dtype=dtype)
    if str(device) != "meta":
        model = model.to_empty(device=device)
        # buffers are not parameters: keep them fp32 (router bias is compared in fp32)
        for mod in model.modules():
            for bname, buf in list(mod.named_buffers(recurse=False)):
                mod.register_buffer(bname, torch.zeros(buf.shape, dtype=torch.float32, device=device))
    return model.eval().requires_grad_(False)  # an inference stack: no autograd graphs, ever


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
               progress: bool = True) -> K3ForCausalLM:
    """Returns the model; calling it on input_ids [B, T] returns logits [B, T, V]."""
    cfg = resolve_config(name_or_path)
    if name_or_path in META_ONLY_PRESETS and str(device) != "meta":
        raise ConfigError(f"preset '{name_or_path}' is full size ({cfg.num_hidden_layers} layers, "
                          f"{cfg.num_experts} experts): it can only be instantiated on device='meta'")
    model = build_model(cfg, dtype, device)
    if str(device) == "meta":
        return model
    if name_or_path in PRESETS:
        init_random(model, seed)
    else:
        load_weights(model, name_or_path, progress=progress)
    return model
