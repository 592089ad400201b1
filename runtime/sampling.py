"""Sampling parameters of one request, and the single-row sampler kept for offline use.

The engine samples whole batches at once (runtime/sampler.py); `sample` here is the same
distribution for one row, used where there is no batch (tests, simple tools).

Every value SamplingParams accepts samples without raising: temperatures below SAMPLING_EPS are
greedy (dividing by them would overflow the logits to inf, as in vLLM), and a seed must fit
torch.Generator (the unsigned 64-bit range, negatives as two's complement).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
SAMPLING_EPS = 1e-5  # vLLM's: temperatures below it are greedy
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16  # 0 only with prompt_logprobs (score the prompt, generate nothing)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI penalties: presence subtracts once per token that occurred in the output, frequency
    # once per occurrence; repetition (vLLM/HF extension) divides positive logits of any token
    # seen in prompt or output (multiplies negative ones). Applied batched (runtime/penalties.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: every prompt token's logprob and the top k
    guide: tuple[str, str] | None = None  # structured output: (kind, spec), runtime/structured_output.py

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_new_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def generator(self) -> torch.Generator | None:
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from fp32 logits [V] (temperature, top-k, top-p; no penalties or bias)."""
    from .sampler import sample_rows

    return sample_rows(logits.float().reshape(1, -1), [params], [gen])[0][0]
