"""The DSpark distillation loss (spec §5.2): alpha_ce * CE(labels) + alpha_l1 * ||p_d - p_t||_1
+ alpha_conf * BCE(confidence, a), with a = sum_v min(p_d, p_t) = 1 - ||p_d - p_t||_1 / 2, the
probability that rejection sampling accepts the draft token (its target is detached)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    position_decay: float = 0.0  # > 0: weight position k by exp(-k / position_decay)


def dspark_loss(draft_logits: torch.Tensor, conf_logits: torch.Tensor, target_logits: torch.Tensor,
                labels: torch.Tensor, w: LossWeights) -> tuple[torch.Tensor, dict]:
    """draft_logits / target_logits [..., G, V], conf_logits / labels [..., G]. Returns (loss, parts)."""
    g = draft_logits.shape[-2]
    weight = torch.ones(g, device=draft_logits.device)
    if w.position_decay > 0:
        weight = torch.exp(-torch.arange(g, device=draft_logits.device) / w.position_decay)
    weight = weight / weight.mean()
    p_d = draft_logits.float().softmax(-1)
    p_t = target_logits.float().softmax(-1)
    ce = F.cross_entropy(draft_logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)
    l1 = (p_d - p_t).abs().sum(-1)
    accept = torch.minimum(p_d, p_t).sum(-1).detach().clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
    ce, l1, bce = ((x * weight).mean() for x in (ce, l1, bce))
    loss = w.ce * ce + w.l1 * l1 + w.conf * bce
    with torch.no_grad():
        greedy_match = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return loss, {"loss": float(loss.detach()), "ce": float(ce.detach()), "l1": float(l1.detach()), "bce": float(bce.detach()),
                  "expected_accept": float(accept.mean()), "greedy_match": float(greedy_match)}
