"""Hugging Face-format checkpoint directories: config.json + safetensors (sharded with an index).

Names on disk are the real checkpoint names (what Moonshot's checkpoints and transformers'
`KimiLinearForCausalLM.save_pretrained` write). In memory, routed experts are stacked
([E, 2I, D] gate|up and [E, D, I] down), so this module maps between the two:

    ...block_sparse_moe.experts.{e}.w1.weight  <->  ...block_sparse_moe.experts.w13[e, :I]
    ...block_sparse_moe.experts.{e}.w3.weight  <->  ...block_sparse_moe.experts.w13[e, I:]
    ...block_sparse_moe.experts.{e}.w2.weight  <->  ...block_sparse_moe.experts.w2[e]

MXFP4 experts (config.expert_quant == "mxfp4", compressed-tensors `mxfp4-pack-quantized` as K3
ships them) map the same way with `.weight_packed` (uint8 codes) -> w13_packed / w2_packed and
`.weight_scale` (uint8 E8M0 exponents) -> w13_scale / w2_scale.

Pickle files are never opened: only safetensors (memory-mapped, loaded tensor by tensor).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .checkpoint_errors import CheckpointError

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
# in-memory stacked experts: w13 / w2, or their MXFP4 codes and scales
_STACKED = re.compile(r"^(.*\.experts)\.(w13|w2)(|_packed|_scale)$")
_SUFFIX = {"": "weight", "_packed": "weight_packed", "_scale": "weight_scale"}
# K3's multimodal checkpoint nests the decoder under `language_model.`; the vision tower is not ours.
_STRIP_PREFIXES = ("language_model.",)
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.", "vision_model.")
_PICKLE_EXT = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class _Target:
    param: torch.Tensor
    index: tuple  # slice of `param` this checkpoint tensor fills (() = the whole tensor)
    shape: tuple  # expected checkpoint shape
    name: str  # in-memory name


def _canonical(name: str) -> str | None:
    for p in _STRIP_PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
    if name.startswith(_IGNORED_PREFIXES):
        return None
    # transformers' save_pretrained renames the dense layer-0 MLP to block_sparse_moe.{gate,up,down}_proj
    return re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", name)


def checkpoint_targets(model: torch.nn.Module) -> dict[str, _Target]:
    """Every checkpoint tensor name the model expects -> where it goes."""
    out: dict[str, _Target] = {}
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    for name, t in state.items():
        stacked = _STACKED.match(name)
        if stacked and stacked.group(2) == "w13":
            base, suffix, inter = stacked.group(1), _SUFFIX[stacked.group(3)], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w1.{suffix}"] = _Target(t, (e, slice(0, inter)), (inter, t.shape[2]), name)
                out[f"{base}.{e}.w3.{suffix}"] = _Target(t, (e, slice(inter, 2 * inter)), (inter, t.shape[2]), name)
        elif stacked:
            base, suffix = stacked.group(1), _SUFFIX[stacked.group(3)]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w2.{suffix}"] = _Target(t, (e,), tuple(t.shape[1:]), name)
        else:
            out[name] = _Target(t, (), tuple(t.shape), name)
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def _a_log_fix(name: str, t: torch.Tensor, expected: tuple) -> torch.Tensor:
    """A_log is per head: transformers stores [1, 1, H, 1]; K3 stores [128] zero-padded past H (spec §1.2)."""
    h = expected[0]
    if t.numel() == h:
        return t.reshape(expected)
    if t.dim() == 1 and t.numel() > h and bool((t[h:] == 0).all()):
        return t[:h]
    raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)}; expected {h} per-head values "
                          f"(or a zero-padded 1-D vector)")


def _mxfp4_tensor(raw: str, fn: str, t: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes / E8M0 scales arrive as uint8 (float8_e8m0fnu is the same bytes); a NaN scale (255)
    is refused here rather than silently poisoning every output that expert touches."""
    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
        t = t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise CheckpointError(f"tensor '{raw}' in {fn} is {t.dtype}; MXFP4 expert codes and scales must be uint8 "
                              f"(config.json declares mxfp4-pack-quantized experts)")
    if raw.endswith("weight_scale") and bool((t == 255).any()):
        raise CheckpointError(f"tensor '{raw}' in {fn} holds {int((t == 255).sum())} E8M0 scale(s) of 255 (NaN)")
    return t


def _list_weight_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index file ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: malformed index file (weight_map must map tensor names to file names)")
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(path, fn)):
                raise CheckpointError(f"{index} lists shard '{fn}', which does not exist")
        return [os.path.join(path, fn) for fn in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(path, f) for f in files]
    pickles = sorted(f for f in os.listdir(path) if f.endswith(_PICKLE_EXT))
    if pickles:
        raise CheckpointError(f"{path}: holds only pickle weight files ({', '.join(pickles[:3])}); k3compile never "
                              f"unpickles weights (unsafe) — convert them to safetensors first")
    raise CheckpointError(f"{path}: no *.safetensors weight files found")


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: str, progress: bool = True) -> None:
    """Fill `model` (already on its target device/dtype) from a checkpoint directory, shard by shard.

    Strict: a missing tensor, an unexpected tensor, or a wrong shape is an error naming it and its file."""
    targets = checkpoint_targets(model)
    seen: set[str] = set()
    files = _list_weight_files(path)
    total = 0
    handles = []
    for fn in files:
        try:
            h = safe_open(fn, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{fn}: not a readable safetensors file ({e})") from None
        handles.append((fn, h))
        total += len(h.keys())
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for fn, h in handles:
        for raw in h.keys():
            bar.update(1)
            name = _canonical(raw)
            if name is None:
                continue
            tgt = targets.get(name)
            if tgt is None and 0 in h.get_slice(raw).get_shape():
                continue  # zero-width tensor (transformers writes empty shared_experts when there are none)
            if tgt is None:
                raise CheckpointError(f"unexpected tensor '{raw}' in {os.path.basename(fn)} (not part of this model)")
            if name in seen:
                raise CheckpointError(f"tensor '{raw}' appears twice (again in {os.path.basename(fn)})")
            try:
                t = h.get_tensor(raw)
            except Exception as e:
                raise CheckpointError(f"{fn}: cannot read tensor '{raw}' ({e})") from None
            if name.endswith("A_log"):
                t = _a_log_fix(raw, t, tgt.shape)
            if tuple(t.shape) != tgt.shape:
                raise CheckpointError(f"tensor '{raw}' in {os.path.basename(fn)} has shape {list(t.shape)}, "
                                      f"expected {list(tgt.shape)}")
            if tgt.param.dtype == torch.uint8:
                t = _mxfp4_tensor(raw, os.path.basename(fn), t)
            dst = tgt.param[tgt.index] if tgt.index else tgt.param
            dst.copy_(t.to(dtype=dst.dtype))
            seen.add(name)
    bar.close()
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")


@torch.no_grad()
def save_checkpoint(model: torch.nn.Module, path: str, max_shard_bytes: int = 2 << 30,
                    hf_compatible_a_log: bool | None = None) -> None:
    """Write config.json + safetensors shards (+ index when sharded) under the checkpoint names."""
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    if hf_compatible_a_log is None:  # transformers' kimi_linear keeps A_log as [1, 1, H, 1]
        hf_compatible_a_log = not cfg.is_k3
    tensors: dict[str, torch.Tensor] = {}
    for name, tgt in checkpoint_targets(model).items():
        t = (tgt.param[tgt.index] if tgt.index else tgt.param).detach().to("cpu").contiguous()
        if name.endswith("A_log") and hf_compatible_a_log:
            t = t.view(1, 1, -1, 1)
        tensors[name] = t.clone()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, os.path.join(path, fn), metadata=meta)
        weight_map.update({k: fn for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
