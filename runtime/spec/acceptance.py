"""Lossless verification of a draft block against the target's distributions (spec §5.2).

For each request the target scored its anchor and the first `num_draft` draft tokens, giving target
distributions at positions 0..num_draft (position k is the distribution of the token after draft k-1;
position num_draft gives the bonus token). Output: how many drafts were accepted (n) and the n + 1
tokens to commit: the accepted drafts, then one target token (the correction at the first rejection,
or the bonus when all were accepted).

* greedy rows: accept while the draft equals the target's argmax; the extra token is the argmax at n.
  This is exactly what non-speculative greedy decoding emits.
* sampled rows (Leviathan et al. / Chen et al. rejection sampling): accept draft x_k with probability
  min(1, p_t(x_k) / p_d(x_k)); at the first rejection draw from normalize(max(0, p_t - p_d)); when all
  are accepted draw the bonus from p_t. The committed tokens are then distributed exactly as if drawn
  from the target one by one. `draft_probs=None` means one-hot drafts (p_d = 1 at the draft token).

Everything is a batched tensor op: one uniform per draft position, one categorical draw per row.
`target_probs` are the distributions the runtime would sample from (after temperature / top-k / top-p /
penalties), so losslessness is with respect to exactly that distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = -1


@dataclass
class Verified:
    accepted: torch.Tensor  # [B] int64: drafts accepted (0..num_draft)
    tokens: torch.Tensor  # [B, gamma + 1] int64: accepted drafts, then the target's token at index accepted; PAD after

    @property
    def num_tokens(self) -> torch.Tensor:
        """[B] tokens to commit (accepted + 1)."""
        return self.accepted + 1

    def rows(self) -> list[list[int]]:
        return [row[: n + 1] for row, n in zip(self.tokens.tolist(), self.accepted.tolist())]


def _check(draft_tokens, draft_probs, target, num_draft):
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, gamma], got {tuple(draft_tokens.shape)}")
    b, g = draft_tokens.shape
    if target.dim() != 3 or target.shape[:2] != (b, g + 1):
        raise ValueError(f"target distributions must be [B, gamma + 1, V] = [{b}, {g + 1}, V], got "
                         f"{tuple(target.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, g, target.shape[2]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must be [B, gamma, V] = {(b, g, target.shape[2])}")
    if num_draft is None:
        return torch.full((b,), g, dtype=torch.long, device=draft_tokens.device)
    num_draft = num_draft.to(device=draft_tokens.device, dtype=torch.long)
    if num_draft.shape != (b,) or bool(((num_draft < 0) | (num_draft > g)).any()):
        raise ValueError(f"num_draft must be [B] with values in 0..{g}")
    return num_draft


def _finish(draft_tokens, accept, num_draft, extra_fn):
    """accept [B, G] bool per position -> Verified, with the extra token from extra_fn(n) [B]."""
    b, g = draft_tokens.shape
    positions = torch.arange(g, device=draft_tokens.device)
    ok = accept & (positions[None, :] < num_draft[:, None])
    n = ok.long().cumprod(1).sum(1)  # length of the all-accepted prefix
    extra = extra_fn(n)
    out = torch.full((b, g + 1), PAD, dtype=torch.long, device=draft_tokens.device)
    keep = positions[None, :] < n[:, None]
    out[:, :g] = torch.where(keep, draft_tokens, out[:, :g])
    out.scatter_(1, n[:, None], extra[:, None])
    return Verified(n, out)


def verify_greedy(draft_tokens: torch.Tensor, target_scores: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> Verified:
    """target_scores [B, gamma + 1, V]: logits or probabilities (only the argmax is used)."""
    num_draft = _check(draft_tokens, None, target_scores, num_draft)
    best = target_scores.argmax(-1)  # [B, G + 1]
    return _finish(draft_tokens, draft_tokens == best[:, :-1], num_draft, lambda n: best.gather(1, n[:, None])[:, 0])


def verify_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   num_draft: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Verified:
    """Rejection sampling; target_probs [B, gamma + 1, V] and draft_probs [B, gamma, V] (or None) sum to 1."""
    num_draft = _check(draft_tokens, draft_probs, target_probs, num_draft)
    b, g = draft_tokens.shape
    p_t = target_probs.float()
    pt_at = p_t[:, :g].gather(2, draft_tokens[..., None])[..., 0]
    pd_at = (draft_probs.float().gather(2, draft_tokens[..., None])[..., 0] if draft_probs is not None
             else torch.ones_like(pt_at))
    u = torch.rand(b, g, generator=generator, device=p_t.device)
    # accept with probability min(1, p_t / p_d): u < p_t / p_d  <=>  u * p_d < p_t (no division by 0)
    accept = u * pd_at < pt_at

    def extra(n):
        rows = torch.arange(b, device=p_t.device)
        target_n = p_t[rows, n]  # [B, V]
        rejected = n < num_draft
        nd = n.clamp(max=g - 1) if g else n
        if g == 0:
            dist = target_n
        else:
            if draft_probs is not None:
                draft_n = draft_probs.float()[rows, nd]
            else:
                draft_n = torch.zeros_like(target_n).scatter_(1, draft_tokens[rows, nd][:, None], 1.0)
            residual = (target_n - draft_n).clamp_min(0)
            mass = residual.sum(-1, keepdim=True)
            # mass 0 only when p_t <= p_d everywhere, i.e. p_t == p_d, where rejection has probability 0
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_n)
            dist = torch.where(rejected[:, None], residual, target_n)
        return torch.multinomial(dist, 1, generator=generator)[:, 0]

    return _finish(draft_tokens, accept, num_draft, extra)


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           greedy: torch.Tensor, num_draft: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> Verified:
    """A mixed batch: rows with greedy[b] use exact-match verification, the others rejection sampling."""
    greedy = greedy.to(device=draft_tokens.device, dtype=torch.bool)
    if bool(greedy.all()):
        return verify_greedy(draft_tokens, target_probs, num_draft)
    sampled = verify_sampled(draft_tokens, draft_probs, target_probs, num_draft, generator)
    if not bool(greedy.any()):
        return sampled
    exact = verify_greedy(draft_tokens, target_probs, num_draft)
    return Verified(torch.where(greedy, exact.accepted, sampled.accepted),
                    torch.where(greedy[:, None], exact.tokens, sampled.tokens))
