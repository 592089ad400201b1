"""A stand-in model step with device-like timing, for benchmarking the served path on a CPU.

    model = TimedStandInModel(step_ms=2.4, token_ms=0.125)        # H200-like: k3-mini-6b decode steps
    engine = LLMEngine(EngineArgs(model="k3-tiny", device="cpu", overlap=True), model=model)

Everything of the engine runs as in serving -- scheduler, radix cache, pools and their snapshot
copies, the ModelRunner's overlap (on a CPU its worker thread stands in for the CUDA stream), batched
sampling, the server -- except the model's forward: `step_tensors` sleeps `step_ms + token_ms *
tokens in the step` (time.sleep releases the GIL, as a host thread waiting for a GPU does) and
returns logits whose argmax is a fixed function of each row's last input token and context length.
So a served run shows what serving adds on top of a step of known cost, at H200-like timings,
without a GPU. `bench serve --stand-in STEP_MS,TOKEN_MS` serves it (bench/serve_stand_in.py).

Tokens. "no-text": ids 259..511 of the byte-level k3-tiny vocabulary, which decode to no text --
what a random-weight model with a large vocabulary (k3-mini-6b: 163840 ids) emits through the byte
tokenizer, where 99.8% of ids are not bytes. "text": lowercase ASCII letters, one character per
token.
"""
from __future__ import annotations

import time

import torch

from .cache_replay import StandInModel

TOKEN_KINDS = {"no-text": (259, 253), "text": (97, 26)}   # (first id, how many ids)


class TimedStandInModel(StandInModel):
    def __init__(self, step_ms: float, token_ms: float = 0.0, tokens: str = "no-text", preset: str = "k3-tiny"):
        if step_ms < 0 or token_ms < 0:
            raise ValueError(f"stand-in step times must be >= 0 ms, got step {step_ms}, per token {token_ms}")
        if tokens not in TOKEN_KINDS:
            raise ValueError(f"stand-in tokens must be one of {', '.join(TOKEN_KINDS)}, got {tokens!r}")
        super().__init__(preset)
        self.step_ms, self.token_ms, self.tokens = step_ms, token_ms, tokens
        first, span = TOKEN_KINDS[tokens]
        if first + span > self.config.vocab_size:
            raise ValueError(f"stand-in tokens {tokens!r} need a vocabulary of {first + span} ids, "
                             f"{preset} has {self.config.vocab_size}")
        self.steps: list[tuple[str, int, int]] = []   # (mode, requests, tokens) per step, in order

    def step_ms_for(self, num_tokens: int) -> float:
        return self.step_ms + self.token_ms * num_tokens

    def step_tensors(self, mode, input_ids, cu_seqlens, seq_lens, page_table, state_slots, out_cache_loc,
                     logits_indices, ssm, conv, kv, **_):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"the timed stand-in has no {mode!r} step")
        n = int(input_ids.shape[0])
        self.steps.append((mode, int(state_slots.shape[0]), n))
        time.sleep(self.step_ms_for(n) / 1000.0)
        first, span = TOKEN_KINDS[self.tokens]
        # the request each logits row belongs to, for its context length
        owner = torch.searchsorted(cu_seqlens[1:].to(torch.int64), logits_indices, right=True)
        nxt = first + (input_ids[logits_indices] * 31 + seq_lens.to(torch.int64)[owner] * 7) % span
        logits = torch.zeros(logits_indices.shape[0], self.config.vocab_size)
        logits.scatter_(1, nxt.unsqueeze(1), 1.0)
        return logits
