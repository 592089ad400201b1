"""Run settings and the optimizer both trainers use: AdamW, linear warmup then cosine decay to 10%, gradient clipping."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class TrainingRun:
    """What both trainers share: optimization, data and evaluation settings (seeded)."""
    out: str
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 2
    corpus_bytes: int = 4 << 20
    device: str = "cpu"


def make_optimizer(params, lr: float, steps: int, warmup: int, weight_decay: float = 0.01):
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor), params


def step_optimizer(opt, sched, params, loss: torch.Tensor, clip: float = 1.0) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    sched.step()
    return float(norm)
