"""Kernel plugins: which `k3::` ops a graph calls and what implements each one.

A k3 op is a `torch.library.custom_op`: a Python module defines it (and its CPU reference) and may
register per-device kernels (fla, Triton, grouped GEMM). The engine records, per op, the defining
module and the implementation on each device as registered in the building process, and loading
imports the defining modules again so the ops exist before the graphs are rebuilt. Only modules
inside the k3compile package are ever imported from a manifest.
"""
from __future__ import annotations

import importlib
import inspect
from collections import Counter

import torch
import torch.fx
from torch._library.custom_ops import OPDEFS

from .format import EngineError

# always imported: they define the ops the model itself uses (and register their CUDA kernels)
BASE_PLUGIN_MODULES = ("k3compile.model_def.ops.library",)
_TRUSTED_PREFIX = "k3compile."


def _describe(fn) -> str:
    # custom_op wraps device kernels in a dispatcher closure; name the function that was registered
    for _ in range(4):
        if not getattr(fn, "__module__", "").startswith("torch"):
            break
        try:
            fn = getattr(fn, "__wrapped__", None) or inspect.getclosurevars(fn).nonlocals.get("fn", fn)
        except (TypeError, ValueError):
            break
    mod = getattr(fn, "__module__", "?")
    return f"{mod}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}".replace(".<locals>", "")


def plugin_manifest(graphs: dict[str, torch.fx.GraphModule]) -> list[dict]:
    """One entry per k3 op overload found in the graphs (counts per graph)."""
    from k3compile.model_def.ops.cuda_backend import BACKENDS

    counts: dict[str, Counter] = {}
    for mode, gm in graphs.items():
        for n in gm.graph.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "k3":
                counts.setdefault(str(n.target), Counter())[mode] += 1
    out = []
    for name, per_graph in sorted(counts.items()):
        qualname = "k3::" + name.split(".")[1]
        opdef = OPDEFS.get(qualname)
        entry = {"op": name, "count": dict(per_graph)}
        if opdef is None:  # a raw torch.library op: still recorded, nothing to import
            entry.update(module=None, cpu="registered kernel", cuda="registered kernel")
        else:
            entry["module"] = opdef._init_fn.__module__
            entry["cpu"] = f"reference ({_describe(opdef._init_fn)})"
            cuda = opdef._backend_fns.get("cuda")
            entry["cuda"] = _describe(cuda) if cuda is not None else entry["cpu"]
            op = name.split(".")[1]
            family = next((f for f in BACKENDS if op == f or op.startswith(f + "_")), None)  # cuda_backend's notes
            if family is not None:
                entry["cuda_backend"] = BACKENDS[family]
        out.append(entry)
    return out


def import_plugins(manifest_plugins: list, source: str) -> None:
    """Import the modules that define the graphs' k3 ops (only k3compile's own modules)."""
    mods = list(BASE_PLUGIN_MODULES)
    for entry in manifest_plugins or []:
        mod = entry.get("module") if isinstance(entry, dict) else None
        if mod is None:
            continue
        if not (isinstance(mod, str) and mod.startswith(_TRUSTED_PREFIX)):
            raise EngineError(f"{source}: kernel plugin module {mod!r} is outside the k3compile package; "
                              f"refusing to import it")
        mods.append(mod)
    for mod in dict.fromkeys(mods):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise EngineError(f"{source}: kernel plugin module '{mod}' cannot be imported ({e})") from None
