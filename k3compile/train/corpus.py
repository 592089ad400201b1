"""An offline text corpus every machine has: the Python standard library's own top-level source files.

Files are taken in sorted name order; every `holdout_every`-th file is held out for validation, so the
split is fixed. Text becomes byte tokens (ByteTokenizer: ids 0..255, bos 256 before each file). The
stdlib differs between Python versions, so the corpus (and a trained model) is reproducible per Python
minor version; `describe()` records which one.
"""
from __future__ import annotations

import glob
import os
import platform
import sysconfig

import torch

from k3compile.tokenizer import ByteTokenizer


def stdlib_files(root: str | None = None) -> list[str]:
    root = root or sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no *.py files under {root}: cannot build the standard-library corpus")
    return files


class Corpus:
    def __init__(self, max_bytes: int = 4 << 20, holdout_every: int = 20, root: str | None = None,
                 tokenizer: ByteTokenizer | None = None):
        tok = tokenizer or ByteTokenizer()
        self.files = stdlib_files(root)
        train, val, used = [], [], 0
        for i, fn in enumerate(self.files):
            if used >= max_bytes:
                break
            with open(fn, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            ids = tok.encode(text, add_bos=True)
            used += len(ids)
            (val if i % holdout_every == 0 else train).extend(ids)
        self.train = torch.tensor(train, dtype=torch.long)
        self.val = torch.tensor(val, dtype=torch.long)
        self.root = root or sysconfig.get_paths()["stdlib"]

    def batch(self, split: str, batch_size: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """[batch_size, length] random crops (seeded by `gen`)."""
        data = self.train if split == "train" else self.val
        if data.numel() <= length:
            raise ValueError(f"the {split} split has {data.numel()} tokens, fewer than one crop of {length}")
        starts = torch.randint(0, data.numel() - length, (batch_size,), generator=gen)
        return torch.stack([data[s: s + length] for s in starts.tolist()])

    def describe(self) -> dict:
        return {"source": "python-stdlib", "python": platform.python_version(), "root": self.root,
                "train_tokens": self.train.numel(), "val_tokens": self.val.numel()}
