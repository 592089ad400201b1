"""The batched sampler: logits rows of one step -> tokens (+ logprobs), every transform a tensor op
over the whole batch.

Order, per row: penalties, logit bias, the structured-output mask, then temperature, top-k, top-p;
the token is drawn from the resulting distribution and its logprobs are read from that same
distribution ("processed" logprobs, vLLM's `logprobs_mode=processed_logprobs`). Greedy rows
(temperature 0) skip temperature/top-k/top-p: their logprobs are those of the penalized, biased,
masked logits at temperature 1, and the token is their argmax. Tokens that top-k / top-p / a mask
removed have logprob -inf.

Random draws: a row with a seed draws on the CPU from its own generator (a seed gives the same
tokens on any device and in any batch); rows without one share one batched draw on the device.

Nothing here waits for the device unless a row needs the host (seeded draws, penalties, masks,
prompt logprobs): `sample_rows_async` leaves the tokens on the device for the next batch and starts
their copy (with the logprobs) into pinned memory behind an event; only ids and logprobs cross.
Prompt logprobs are the raw model distribution (log-softmax of the logits, nothing applied).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .penalties import apply_logit_bias, apply_penalties, apply_token_bitmask
from .sampling import SamplingParams


@dataclass
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (id, logprob), most likely first


def to_device(values, dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device: through pinned
    memory, copied asynchronously (a plain torch.tensor(..., device=cuda) synchronizes the stream,
    which would wait for the forward in flight)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class DeviceSample:
    """One sampling pass launched on the logits' device. `tokens` [R] stay on the device (the next
    batch reads its input ids from them); their host copy (and the logprobs') is already on its way
    into pinned memory. `result()` waits for it (an event, not a stream sync) and returns
    (token per row, logprobs per row, non-finite flag per row)."""

    def __init__(self, tokens: torch.Tensor, bad: torch.Tensor | None, chosen: torch.Tensor | None,
                 top_v: torch.Tensor | None, top_i: torch.Tensor | None, lp_rows: list[int], wants: list):
        self.tokens = tokens
        self._wants, self._lp_rows = wants, lp_rows
        cuda = tokens.device.type == "cuda"
        self._host = [None if t is None else _to_host(t, cuda) for t in (tokens, bad, chosen, top_v, top_i)]
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> tuple[list[int], list["TokenLogprobs | None"], list[bool]]:
        if self._event is not None:
            self._event.synchronize()
        tokens, bad, chosen, top_v, top_i = (None if t is None else t.tolist() for t in self._host)
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        for j, i in enumerate(self._lp_rows):
            k = self._wants[i]
            out[i] = TokenLogprobs(tokens[i], chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return tokens, out, bad if bad is not None else [False] * len(tokens)


def _to_host(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    if not cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


NON_FINITE = "the model produced non-finite logits for a sampled request"


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list,
                prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
                mask_rows: list[int] = (), bitmask: torch.Tensor | None = None
                ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [R, V] (not modified) -> (token per row, logprobs per row where params.logprobs is set).
    Raises ValueError when a sampled (non-greedy) row has non-finite logits."""
    tokens, lps, bad = sample_rows_async(logits, params, generators, prompts, outputs, mask_rows, bitmask).result()
    if any(bad):
        raise ValueError(NON_FINITE)
    return tokens, lps


def sample_rows_async(logits: torch.Tensor, params: list[SamplingParams], generators: list,
                      prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
                      mask_rows: list[int] = (), bitmask: torch.Tensor | None = None) -> DeviceSample:
    """The same pass without waiting for the device: greedy, temperature, top-k/top-p rows and their
    logprobs are tensor ops over the whole batch and nothing is read back here. Penalties, structured
    output masks and seeded rows (their draw runs on the request's CPU generator) do read the host;
    the engine runs batches holding them in order rather than overlapped. A sampled row with
    non-finite logits draws from a uniform row instead (so no NaN reaches a kernel) and is flagged."""
    r = logits.shape[0]
    dev = logits.device
    x = logits.float()
    empty = [[] for _ in range(r)]
    if any(p.penalized or p.logit_bias for p in params) or bitmask is not None:
        x = x.clone()   # the logits may be a CUDA graph's static output: never write them
        apply_penalties(x, params, prompts or empty, outputs or empty)
        apply_logit_bias(x, params)
        if bitmask is not None:
            apply_token_bitmask(x, list(mask_rows), bitmask)
    greedy = [p.greedy for p in params]
    bad = None
    if not all(greedy):
        sampled = to_device([not g for g in greedy], torch.bool, dev)
        bad = sampled & ~torch.isfinite(logits).all(dim=-1)
        x = x.masked_fill(bad[:, None], 0.0)
        x = _temper(x, params, greedy)
    # an all-greedy batch without logprobs needs only the argmax
    wants = [p.logprobs for p in params]
    need = not all(greedy) or any(k is not None for k in wants)
    logprobs = torch.log_softmax(x, dim=-1) if need else None

    tokens = x.argmax(-1)
    if not all(greedy):
        # one batched draw for the rows without a seed: argmax of p / Exp(1) noise samples from p
        # (the exponential-race form of Gumbel-max; no host round trip as torch.multinomial has)
        probs = logprobs.exp()
        noise = torch.empty_like(probs).exponential_().clamp_min_(1e-30)
        drawn = (probs / noise).argmax(-1)
        tokens = torch.where(to_device(greedy, torch.bool, dev), tokens, drawn)
        for i, g in enumerate(greedy):
            if not g and generators[i] is not None:   # reproducible on any device: the request's CPU generator
                p = logprobs[i].exp().cpu()
                tokens[i] = int(torch.multinomial(p / p.sum(), 1, generator=generators[i]))
    lp_rows = [i for i, k in enumerate(wants) if k is not None]
    chosen = top_v = top_i = None
    if lp_rows:
        k = max(wants[i] for i in lp_rows)
        idx = to_device(lp_rows, torch.int64, dev)
        sub = logprobs[idx]
        chosen = sub.gather(1, tokens[idx][:, None]).squeeze(1)
        top_v, top_i = sub.topk(k, dim=-1) if k else (sub[:, :0], sub[:, :0].long())
    return DeviceSample(tokens, bad, chosen, top_v, top_i, lp_rows, wants)


def _temper(x: torch.Tensor, params: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
    """Temperature, then top-k / top-p, on the non-greedy rows (greedy rows only shifted)."""
    temps = to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, x.device)
    # shifted to <= 0 first: a temperature down to SAMPLING_EPS cannot overflow a logit to inf
    x = (x - x.max(dim=-1, keepdim=True).values) / temps[:, None]
    ks = [p.top_k if p.top_k and not g else 0 for p, g in zip(params, greedy)]
    ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    if any(ks) or any(p < 1.0 for p in ps):
        _truncate(x, ks, ps)
    return x


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] of sampled (temperature > 0) rows without penalties, bias or masks -> the distribution
    `sample_rows` draws each row's token from (temperature, top-k, top-p), [R, V] fp32. Speculative
    decoding's rejection sampling verifies drafts against exactly this distribution."""
    if any(p.greedy or p.penalized or p.logit_bias for p in params):
        raise ValueError("sampling_probs takes sampled rows without penalties or logit bias")
    return torch.softmax(_temper(logits.float(), params, [False] * len(params)), dim=-1)


def _truncate(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """Top-k then top-p per row, in place (removed tokens -> -inf); one sort for the batch."""
    dev, vocab = x.device, x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    k = to_device([min(kk, vocab) if kk else vocab for kk in ks], torch.int64, dev)[:, None]  # top_k may exceed int64
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    probs = sorted_x.softmax(-1)
    top_p = to_device(ps, torch.float32, dev)[:, None]
    remove = (rank >= k) | (probs.cumsum(-1) - probs >= top_p)
    remove[:, 0] = False  # the most likely token always stays (a top_p below fp32's range rounds to 0)
    x.masked_fill_(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Raw logprobs of `next_ids[t]` under logits row t ([T, V]), with the top k alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(next_ids, device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    else:
        top_v = top_i = [[] for _ in next_ids]
    return [TokenLogprobs(t, c, list(zip(ti, tv))) for t, c, ti, tv in zip(next_ids, chosen, top_i, top_v)]
