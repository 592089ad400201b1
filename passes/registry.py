"""The pass registry: every graph pass by name, with its typed config.

A pass is a function `run(gm: torch.fx.GraphModule, config) -> int` that rewrites `gm.graph` in
place and returns its match count (how many rewrites it made; 0 means the graph is unchanged).
It lives in its own module `passes/pNN_<what>.py` and registers itself with

    @dataclass
    class GemmMergeConfig(PassConfig):
        min_group: int = 2

    @register_pass("p01_gemm_merge", GemmMergeConfig)
    def gemm_merge(gm, config): ...

Names start with the DESIGN.md P-number (`p01_` ... `p15_`), so sorting them gives the default
pipeline order. Modules named `pNN_*.py` in this folder are discovered and imported on first use,
so adding a pass is adding one file.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable

import torch

from k3compile.model_def.config import ConfigError

_PASS_MODULE = re.compile(r"^p\d\d_\w+$")


class PassConfigError(ConfigError):
    """A pipeline config (file or flags) names an unknown pass or option, or gives a bad value."""


@dataclass
class PassConfig:
    """Fields every pass config has. Subclasses add the pass's own options (with defaults)."""
    enabled: bool = True

    def validate(self) -> None:
        """Raise PassConfigError naming a bad option value. Subclasses extend this."""


@dataclass(frozen=True)
class PassSpec:
    name: str
    run: Callable[[torch.fx.GraphModule, PassConfig], int]
    config_cls: type
    description: str

    def default_config(self) -> PassConfig:
        return self.config_cls()


_REGISTRY: dict[str, PassSpec] = {}
_discovered = False


def register_pass(name: str, config_cls: type = PassConfig):
    """Decorator: register `fn(gm, config) -> int` under `name` with config dataclass `config_cls`."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, PassConfig) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"pass {name!r}: config_cls must be a dataclass subclass of PassConfig")

    def wrap(fn):
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise ValueError(f"pass {name!r} is already registered (by {_REGISTRY[name].run.__module__})")
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = PassSpec(name, fn, config_cls, doc[0] if doc else "")
        return fn
    return wrap


def unregister_pass(name: str) -> None:
    """Remove a pass (tests register throwaway passes and clean up after themselves)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    import k3compile.passes as pkg
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if _PASS_MODULE.match(info.name):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def registered_passes() -> dict[str, PassSpec]:
    """All passes, sorted by name (= default pipeline order)."""
    _discover()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> PassSpec:
    passes = registered_passes()
    if name not in passes:
        raise PassConfigError(f"unknown pass {name!r}; known passes: {', '.join(passes) or '(none)'}")
    return passes[name]


def resolve_pass_name(name: str) -> str:
    """Full name from a full name or a unique prefix (`p01` -> `p01_gemm_merge`)."""
    passes = registered_passes()
    name = name.strip()
    if name in passes:
        return name
    hits = [n for n in passes if n.startswith(name + "_") or (len(name) > 3 and n.startswith(name))]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise PassConfigError(f"unknown pass {name!r}; known passes: {', '.join(passes) or '(none)'}")
    raise PassConfigError(f"pass name {name!r} is ambiguous: {', '.join(hits)}")
