"""Drafter checkpoints, Hugging Face style: config.json (model_type k3_dspark_drafter) + model.safetensors.

Only the drafter's own tensors are stored: the embedding and LM head are the target's (bound at load),
and a checkpoint that carries them is refused rather than silently ignored.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import _list_weight_files
from .checkpoint_errors import CheckpointError
from .drafter import K3DSparkDrafter
from .drafter_config import load_drafter_config

WEIGHTS = "model.safetensors"
_SHARED_NAMES = ("embed_tokens", "lm_head")


@torch.no_grad()
def save_drafter(drafter: K3DSparkDrafter, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(drafter.config.to_dict(), f, indent=2)
    tensors = {n: p.detach().to("cpu").contiguous().clone() for n, p in drafter.state_dict().items()}
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})


@torch.no_grad()
def load_drafter(path: str, target, dtype: torch.dtype | None = None, device=None) -> K3DSparkDrafter:
    """Build the drafter from `path`, bound to `target` (K3ForCausalLM); strict about names and shapes."""
    cfg = load_drafter_config(path)
    cfg.check_target(target.config)
    device = device if device is not None else target.lm_head.weight.device
    dtype = dtype or target.lm_head.weight.dtype
    drafter = K3DSparkDrafter(cfg).to(device=device, dtype=dtype)
    expected = drafter.state_dict()
    seen: set[str] = set()
    for fn in _list_weight_files(path):
        try:
            handle = safe_open(fn, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{fn}: not a readable safetensors file ({e})") from None
        for name in handle.keys():
            if any(s in name for s in _SHARED_NAMES):
                raise CheckpointError(f"drafter checkpoint {path} carries '{name}': the embedding and LM head are "
                                      f"the target's and must not be stored with the drafter")
            if name not in expected:
                raise CheckpointError(f"unexpected tensor '{name}' in {os.path.basename(fn)} (not part of the "
                                      f"drafter)")
            t = handle.get_tensor(name)
            if tuple(t.shape) != tuple(expected[name].shape):
                raise CheckpointError(f"tensor '{name}' in {os.path.basename(fn)} has shape {list(t.shape)}, "
                                      f"expected {list(expected[name].shape)}")
            expected[name].copy_(t.to(expected[name].dtype))
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{path}: drafter checkpoint is missing tensor(s) {', '.join(missing[:5])}")
    return drafter.eval().requires_grad_(False).bind(target)
