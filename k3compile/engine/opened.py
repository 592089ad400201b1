"""`open_engine(DIR)`: everything an engine directory says, read in one place.

    opened = open_engine("engines/mini", device="cuda")
    opened.engine, opened.tokenizer, opened.dtype, opened.page_size, opened.decode_buckets

`serve`, `generate`, `bench` and the runtime's LLMEngine all open engines through this, so the
settings `build` wrote into engine.json (dtype, page size, decode buckets) are the ones they run
with, and the tokenizer comes from the engine's tokenizer/ folder (or, without one, the byte
tokenizer the model's vocabulary allows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from k3compile.model_def.dtypes import DTYPE_NAMES
from k3compile.tokenizer import load_tokenizer

from .engine import Engine
from .format import MANIFEST, TOKENIZER_DIR


@dataclass
class OpenedEngine:
    engine: Engine
    tokenizer: object | None  # None: the model has no tokenizer (token ids only)
    dtype: str  # "fp32" | "bf16" | "fp16": what the engine was built for
    page_size: int
    decode_buckets: tuple[int, ...]
    path: str


def is_engine_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def open_engine(path: str, device=None, trust_remote_code: bool = False,
                verify_checksums: bool = True) -> OpenedEngine:
    """Load the engine at `path` with its tokenizer and settings (EngineError names what is wrong)."""
    engine = Engine.load(path, device=device, verify_checksums=verify_checksums)
    return OpenedEngine(engine, engine_tokenizer(path, engine.config, trust_remote_code),
                        DTYPE_NAMES[engine.dtype], engine.page_size, engine.decode_buckets, path)


def engine_tokenizer(path: str, config, trust_remote_code: bool = False):
    tok_dir = os.path.join(path, TOKENIZER_DIR)
    try:
        return load_tokenizer(tok_dir if os.path.isdir(tok_dir) else path, config, trust_remote_code)
    except ValueError:
        return None
