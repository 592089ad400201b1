"""Write an engine directory (layout in format.py), atomically.

Everything goes into a staging directory next to the destination; only a complete directory with
its manifest is renamed into place, so a crashed build never leaves a half-written engine that
loads. Weights shared by the decode and prefill graphs are stored once.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.fx

from . import format as fmt
from .engine import DTYPE_NAMES, Engine
from .graph_io import graph_to_dict
from .plugins import plugin_manifest
from .report import build_report


class StagedDir:
    """A staging directory that becomes `dest` on commit(); abort() removes it."""

    def __init__(self, dest: str, overwrite: bool = False):
        self.dest = os.path.abspath(dest)
        if os.path.exists(self.dest):
            if not os.path.isdir(self.dest):
                raise fmt.EngineError(f"{dest}: exists and is not a directory")
            if os.listdir(self.dest) and not overwrite:
                raise fmt.EngineError(f"{dest}: directory exists and is not empty (pass --overwrite to replace it)")
            if os.listdir(self.dest) and not os.path.isfile(os.path.join(self.dest, fmt.MANIFEST)):
                raise fmt.EngineError(f"{dest}: not an engine directory; refusing to replace it")
        parent = os.path.dirname(self.dest)
        os.makedirs(parent, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix=os.path.basename(self.dest) + ".staging-", dir=parent)

    def commit(self) -> str:
        if os.path.exists(self.dest):
            shutil.rmtree(self.dest)
        os.replace(self.dir, self.dest)
        return self.dest

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _identity(t: torch.Tensor):
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def collect_weights(graphs: dict[str, torch.fx.GraphModule]):
    """Distinct tensors the graphs read -> (weights {key: tensor}, per-graph {attr target: key})."""
    weights: dict[str, torch.Tensor] = {}
    by_identity: dict[tuple, str] = {}
    keys: dict[str, dict[str, str]] = {}
    for mode, gm in graphs.items():
        keys[mode] = {}
        for n in gm.graph.nodes:
            if n.op != "get_attr" or n.target in keys[mode]:
                continue
            t = _get_attr(gm, n.target)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{mode} graph: get_attr {n.target} is a {type(t).__name__}, not a tensor")
            t = t.detach()
            key = by_identity.get(_identity(t))
            if key is None:
                key = n.target
                if key in weights and not _same(weights[key], t):
                    key = f"{mode}.{n.target}"  # same name, different content (a pass rewrote it per graph)
                if key not in weights:
                    weights[key] = t
                by_identity[_identity(t)] = key
            keys[mode][n.target] = key
    return _unshare(weights), keys


def _get_attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def _unshare(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage: give overlapping views their own copy."""
    seen: set[tuple] = set()
    out = {}
    for key, t in weights.items():
        storage = (t.device, t.untyped_storage().data_ptr())
        if storage in seen or not t.is_contiguous() or t.numel() * t.element_size() != t.untyped_storage().nbytes():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        out[key] = t
    return out


def write_engine(stage_dir: str, engine: Engine, source: str, passes: dict, build: dict,
                 tokenizer_src: str | None = None, parallel: dict | None = None) -> dict:
    """Write weights, graphs, tokenizer, report and (last) the manifest into `stage_dir`; returns the manifest.
    `parallel`: for one rank of a parallel engine, {"topology", "experts", "rank", "world", "plan"}."""
    from safetensors.torch import save_file

    import k3compile

    weights, keys = collect_weights(engine.graphs)
    save_file(weights, os.path.join(stage_dir, fmt.WEIGHTS), metadata={"format": "k3compile-engine"})
    os.makedirs(os.path.join(stage_dir, fmt.GRAPHS_DIR), exist_ok=True)
    for mode, gm in engine.graphs.items():
        fmt.write_json(os.path.join(stage_dir, fmt.graph_file(mode)), graph_to_dict(gm, mode, keys[mode]))
    if tokenizer_src is not None:
        _copy_tokenizer(tokenizer_src, os.path.join(stage_dir, fmt.TOKENIZER_DIR))
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "model": {"name": engine.config.name, "source": source, "hf_config": engine.config.to_hf_dict()},
        "dtype": DTYPE_NAMES[engine.dtype],
        "topology": parallel["topology"] if parallel else "single",
        "page_size": engine.page_size,
        "decode_buckets": list(engine.decode_buckets),
        "graphs": sorted(engine.graphs),
        "passes": passes,
        "kernel_plugins": plugin_manifest(engine.graphs),
        "weights": {"file": fmt.WEIGHTS, "tensors": len(weights),
                    "bytes": sum(t.numel() * t.element_size() for t in weights.values())},
        "versions": {"k3compile": k3compile.__version__, "torch": torch.__version__},
        "build": build,
    }
    if parallel:
        manifest["parallel"] = parallel
    with open(os.path.join(stage_dir, fmt.REPORT), "w") as f:
        f.write(build_report(manifest, engine.graphs))
    manifest["files"] = fmt.checksum_tree(stage_dir)
    fmt.write_json(os.path.join(stage_dir, fmt.MANIFEST), manifest)
    return manifest


def _copy_tokenizer(src: str, dst: str) -> None:
    from k3compile.tokenizer import _TOKENIZER_FILES

    extra = ("special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json")
    names = [n for n in (*_TOKENIZER_FILES, *extra) if os.path.isfile(os.path.join(src, n))]
    names += [n for n in os.listdir(src) if n.startswith("tokenization_") and n.endswith(".py")]  # remote code
    if not names:
        return
    os.makedirs(dst, exist_ok=True)
    for n in names:
        shutil.copy2(os.path.join(src, n), os.path.join(dst, n))
