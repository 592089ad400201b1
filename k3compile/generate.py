"""Single-prompt generation over the step contract: chunked prefill, then one decode step per token.

`model` is anything the executor runs (K3ForCausalLM or an Engine): steps go through
runtime.executor, so on CUDA the decode steps replay a CUDA graph.
"""
from __future__ import annotations

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.runtime.executor import Executor, provider_device
from k3compile.runtime.memory.pools import SplitPools
from k3compile.runtime.sampling import SamplingParams, sample


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], params: SamplingParams, page_size: int = 16,
                 chunk_size: int = 256, eos_token_id: int | None = None, on_token=None,
                 cuda_graphs: bool | None = None) -> list[int]:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    cfg = model.config
    total = len(prompt_ids) + params.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                         f"context length {cfg.max_position_embeddings}")
    device = provider_device(model)
    n_pages = (total + page_size - 1) // page_size
    pools = SplitPools(model.cache_spec(), 2, n_pages + 1, page_size, device)
    executor = Executor(model, pools.tensors, cuda_graphs=cuda_graphs, buckets=(1,), max_context=n_pages * page_size)
    slot, pages = pools.alloc_slot(), pools.alloc_pages(n_pages)
    gen = params.generator()
    stops = set(params.stop_token_ids) | ({eos_token_id} if eos_token_id is not None and not params.ignore_eos else set())

    def run(mode, toks, prefix):
        b = ForwardBatch.build(mode, [toks], [prefix], [pages], [slot], page_size, device=device)
        return executor.run(b)[0]

    logits = None
    for start in range(0, len(prompt_ids), chunk_size):
        logits = run("prefill", prompt_ids[start:start + chunk_size], start)
    out: list[int] = []
    while True:
        tok = sample(logits, params, gen)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in stops or len(out) >= params.max_new_tokens:
            return out
        logits = run("decode", [tok], len(prompt_ids) + len(out) - 1)
