"""`k3compile train`: next-token training of a small K3 target (a preset's shape, its seeded random
init) on the standard-library corpus, through the model's differentiable `train_forward`."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3compile.model_def.checkpoint import save_checkpoint
from k3compile.model_def.loader import load_model

from .corpus import Corpus
from .curves import Curves
from .schedule import TrainingRun, make_optimizer, step_optimizer


@dataclass(kw_only=True)
class TargetRun(TrainingRun):
    model: str = "k3-tiny"


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model.train_forward(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, corpus: Corpus, run: TargetRun) -> float:
    gen = torch.Generator().manual_seed(run.seed + 1)  # the same validation crops every time
    losses = [float(lm_loss(model, corpus.batch("val", run.batch_size, run.seq_len + 1, gen).to(run.device)))
              for _ in range(run.eval_batches)]
    return sum(losses) / len(losses)


def train_target(run: TargetRun, corpus: Corpus | None = None) -> dict:
    torch.manual_seed(run.seed)
    corpus = corpus or Corpus(run.corpus_bytes)
    model = load_model(run.model, dtype=torch.float32, device=run.device, seed=run.seed).requires_grad_(True)
    if model.config.vocab_size < 258:
        raise ValueError(f"model {run.model}: vocabulary {model.config.vocab_size} is too small for byte tokens")
    opt, sched, params = make_optimizer(model.parameters(), run.lr, run.steps, run.warmup)
    os.makedirs(run.out, exist_ok=True)
    curves = Curves(run.out, "target_loss", {"run": vars(run), "corpus": corpus.describe(),
                                               "params": sum(p.numel() for p in params)})
    gen = torch.Generator().manual_seed(run.seed)
    start = time.time()
    curves.log("val", 0, loss=evaluate(model, corpus, run))
    for step in range(1, run.steps + 1):
        ids = corpus.batch("train", run.batch_size, run.seq_len + 1, gen).to(run.device)
        loss = lm_loss(model, ids)
        gnorm = step_optimizer(opt, sched, params, loss)
        curves.log("train", step, loss=float(loss.detach()), grad_norm=gnorm)
        if step % run.eval_every == 0 or step == run.steps:
            curves.log("val", step, loss=evaluate(model, corpus, run))
    model.requires_grad_(False).eval()
    save_checkpoint(model, run.out)
    summary = {"seconds": round(time.time() - start, 1), "final_val_loss": curves.data["val"][-1]["loss"]}
    png = curves.save({"summary": summary})
    return {**summary, "checkpoint": run.out, "curves": curves.path_json, "plot": png}
