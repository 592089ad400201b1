"""The batched sampler: logits rows of one step -> tokens (+ logprobs), every transform a tensor op
over the whole batch.

Order, per row: penalties, logit bias, the structured-output mask, then temperature, top-k, top-p;
the token is drawn from the resulting distribution and its logprobs are read from that same
distribution ("processed" logprobs, vLLM's `logprobs_mode=processed_logprobs`). Greedy rows
(temperature 0) skip temperature/top-k/top-p: their logprobs are those of the penalized, biased,
masked logits at temperature 1, and the token is their argmax. Tokens that top-k / top-p / a mask
removed have logprob -inf.

Random draws: a row with a seed draws on the CPU from its own generator (a seed gives the same
tokens on any device and in any batch); rows without one share one batched multinomial.
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


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list,
                prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
                mask_rows: list[int] = (), bitmask: torch.Tensor | None = None
                ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [R, V] (not modified) -> (token per row, logprobs per row where params.logprobs is set)."""
    r = logits.shape[0]
    x = logits.float()
    empty = [[] for _ in range(r)]
    if any(p.penalized or p.logit_bias for p in params) or bitmask is not None:
        x = x.clone()   # the logits may be a CUDA graph's static output: never write them
        apply_penalties(x, params, prompts or empty, outputs or empty)
        apply_logit_bias(x, params)
        if bitmask is not None:
            apply_token_bitmask(x, list(mask_rows), bitmask)
    dev = x.device
    greedy = [p.greedy for p in params]
    if not all(greedy):
        sampled = [i for i, g in enumerate(greedy) if not g]
        if not bool(torch.isfinite(logits[sampled]).all()):
            raise ValueError("the model produced non-finite logits for a sampled request")
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=dev)
        # shifted to <= 0 first: a temperature down to SAMPLING_EPS cannot overflow a logit to inf
        x = (x - x.max(dim=-1, keepdim=True).values) / temps[:, None]
        ks = [p.top_k if p.top_k and not g else 0 for p, g in zip(params, greedy)]
        ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        if any(ks) or any(p < 1.0 for p in ps):
            _truncate(x, ks, ps)
    # an all-greedy batch without logprobs needs only the argmax
    need = not all(greedy) or any(p.logprobs is not None for p in params)
    logprobs = torch.log_softmax(x, dim=-1) if need else None

    tokens = torch.empty(r, dtype=torch.int64, device=dev)
    g_rows = [i for i in range(r) if greedy[i]]
    if g_rows:
        tokens[g_rows] = x[g_rows].argmax(-1)
    s_rows = [i for i in range(r) if not greedy[i]]
    shared = [i for i in s_rows if generators[i] is None]
    if shared:
        tokens[shared] = torch.multinomial(logprobs[shared].exp(), 1).squeeze(1)
    for i in s_rows:
        if generators[i] is not None:
            probs = logprobs[i].exp().cpu()
            tokens[i] = int(torch.multinomial(probs / probs.sum(), 1, generator=generators[i]))
    out = tokens.tolist()
    return out, _gather(logprobs, tokens, [p.logprobs for p in params], out)


def _truncate(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """Top-k then top-p per row, in place (removed tokens -> -inf); one sort for the batch."""
    dev, vocab = x.device, x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    k = torch.tensor([min(kk, vocab) if kk else vocab for kk in ks], device=dev)[:, None]  # top_k may exceed int64
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    probs = sorted_x.softmax(-1)
    top_p = torch.tensor(ps, device=dev)[:, None]
    remove = (rank >= k) | (probs.cumsum(-1) - probs >= top_p)
    remove[:, 0] = False  # the most likely token always stays (a top_p below fp32's range rounds to 0)
    x.masked_fill_(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))


def _gather(logprobs: torch.Tensor, tokens: torch.Tensor, wants: list[int | None],
            token_list: list[int]) -> list[TokenLogprobs | None]:
    rows = [i for i, k in enumerate(wants) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(wants)
    if not rows:
        return out
    k = max(wants[i] for i in rows)
    sub = logprobs[rows]
    chosen = sub.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    top_v, top_i = sub.topk(k, dim=-1) if k else (sub[:, :0], sub[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        kk = wants[i]
        out[i] = TokenLogprobs(token_list[i], chosen[j], list(zip(top_i[j][:kk], top_v[j][:kk])))
    return out


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
