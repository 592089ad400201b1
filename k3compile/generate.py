"""Single-prompt generation: one request through the runtime's LLMEngine (chunked prefill, then one
decode step per token).

`model` is anything the executor runs (K3ForCausalLM or an Engine); on CUDA the decode steps replay
a CUDA graph. The engine gets memory for exactly this request and no prefix cache.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], params: SamplingParams, page_size: int = 16,
                 chunk_size: int = 256, eos_token_id: int | None = None, on_token=None,
                 cuda_graphs: bool | None = None, speculation: dict | None = None) -> list[int]:
    """`speculation`: speculative-decoding EngineArgs fields (speculative=..., draft=..., ...), or None."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    cfg = model.config
    total = len(prompt_ids) + params.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                         f"context length {cfg.max_position_embeddings}")
    # eos is just one more stop token here (the engine would otherwise take the tokenizer's)
    if eos_token_id is not None and not params.ignore_eos:
        params = replace(params, stop_token_ids=tuple(params.stop_token_ids) + (eos_token_id,))
    params = replace(params, ignore_eos=True)
    spec = model.cache_spec()
    slot_bytes, page_bytes = 3 * spec.slot_bytes, (-(-total // page_size) + 2) * spec.page_bytes(page_size)
    args = EngineArgs(model=None, page_size=page_size, chunk_size=chunk_size, enable_prefix_cache=False,
                      memory_bytes=slot_bytes + page_bytes, state_fraction=slot_bytes / (slot_bytes + page_bytes),
                      track_interval=page_size, max_context=total, cuda_graphs=cuda_graphs, cuda_graph_buckets=(1,),
                      **(speculation or {}))
    engine = LLMEngine(args, model=model, eos_token_id=None)
    engine.add_request("generate", list(prompt_ids), params)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.error is not None:
                engine.close()
                raise RuntimeError(o.error)
            for tok in o.new_token_ids:
                out.append(tok)
                if on_token is not None:
                    on_token(tok)
    engine.close()
    return out
