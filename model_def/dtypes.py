"""The one table of dtypes a model runs in, by the names the CLI, EngineArgs and engine manifests use."""
from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
