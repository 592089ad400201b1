"""k3compile: a compiler-driven serving stack for Kimi-K3-class hybrid KDA / MLA models."""
from k3compile.model_def.config import ModelConfig, get_preset  # noqa: F401
from k3compile.model_def.loader import load_model  # noqa: F401
from k3compile.engine import Engine  # noqa: F401

__version__ = "0.1.0"
