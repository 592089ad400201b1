"""k3compile: a compiler-driven serving stack for Kimi-K3-class hybrid KDA / MLA models.

The top-level names are imported on first use, so `import k3compile.model_def.batch` (or any other
submodule) loads that module alone, not the whole stack."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "k3compile.model_def.config",
    "get_preset": "k3compile.model_def.config",
    "load_model": "k3compile.model_def.loader",
    "Engine": "k3compile.engine",
    "open_engine": "k3compile.engine",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'k3compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
