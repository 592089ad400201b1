"""Test helpers: run requests through the step contract with a simple page/slot layout."""
from __future__ import annotations

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors


class Sessions:
    """Gives each request a fixed slot and a contiguous run of pages (enough for `max_len` tokens)."""

    def __init__(self, model, n_requests: int, max_len: int, page_size: int = 4):
        self.model, self.page_size = model, page_size
        self.pages_per_req = (max_len + page_size - 1) // page_size
        self.cache = CacheTensors.allocate(model.cache_spec(), n_requests + 1, n_requests * self.pages_per_req + 1,
                                           page_size)
        self.lens = [0] * n_requests

    def row(self, r):
        # interleave page ids across requests so a wrong page table shows up as wrong numbers
        n = len(self.lens)
        return [1 + r + n * j for j in range(self.pages_per_req)]

    def step(self, mode, reqs, tokens, logits="last"):
        batch = ForwardBatch.build(mode, tokens, [self.lens[r] for r in reqs], [self.row(r) for r in reqs],
                                   [r + 1 for r in reqs], self.page_size, logits=logits)
        with torch.no_grad():
            out = self.model.step(batch, self.cache)
        for r, t in zip(reqs, tokens):
            self.lens[r] += len(t)
        return out


def assert_fla_in_use() -> None:
    """For GPU tests about fla's kernels: fail (not silently test the reference) when fla did not register."""
    from k3compile.model_def.ops.cuda_backend import BACKENDS

    assert BACKENDS.get("kda") == "fla", f"fla's KDA kernels are not in use: {BACKENDS}"
    for op in ("kda_prefill", "kda_decode"):
        import torch
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"k3::{op}", "CUDA"), f"k3::{op} has no CUDA kernel"
