"""`k3compile train-draft`: distill a DSpark drafter from a trained target (target frozen).

Per step: crops [S, T] from the corpus; the target's logits and features (model.py FEATURES) for every
position; A random anchor positions per crop; one drafter forward for all S * A blocks (each block
reads the context rows before its anchor, within `context_window`) with the true previous tokens fed
to the Markov and confidence heads (teacher forcing); the DSpark loss against the target's
distributions at the same positions.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from k3compile.model_def.drafter import K3DSparkDrafter
from k3compile.model_def.drafter_checkpoint import save_drafter
from k3compile.model_def.drafter_config import DrafterConfig
from k3compile.model_def.loader import load_model

from .corpus import Corpus
from .curves import Curves
from .dspark_loss import LossWeights, dspark_loss
from .schedule import TrainingRun, make_optimizer, step_optimizer


@dataclass(kw_only=True)
class DraftRun(TrainingRun):
    target: str
    anchors: int = 16
    block_size: int = 8
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    markov_rank: int = 32
    target_layer_ids: tuple[int, ...] | None = None  # default: 3 layers spread over the target
    mask_token_id: int | None = None  # default: the last vocabulary id (unused by the byte tokenizer)
    weights: LossWeights = field(default_factory=LossWeights)


def default_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` target layers from layer 1 to the last, evenly spread (DFlash-style shallow..deep mix)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    return tuple(sorted({round(1 + i * (num_layers - 2) / (count - 1)) for i in range(count)}))


def drafter_config(run: DraftRun, target_cfg) -> DrafterConfig:
    return DrafterConfig(vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
                         target_num_layers=target_cfg.num_hidden_layers,
                         target_layer_ids=run.target_layer_ids or default_layers(target_cfg.num_hidden_layers),
                         mask_token_id=target_cfg.vocab_size - 1 if run.mask_token_id is None else run.mask_token_id,
                         block_size=run.block_size, num_hidden_layers=run.layers, num_attention_heads=run.heads,
                         head_dim=run.head_dim, intermediate_size=4 * target_cfg.hidden_size,
                         markov_rank=run.markov_rank, rms_norm_eps=target_cfg.rms_norm_eps)


def block_batch(drafter: K3DSparkDrafter, target, ids: torch.Tensor, anchors: int, gamma: int,
                gen: torch.Generator):
    """Everything one teacher-forced step needs for crops ids [S, T]: (draft logits, confidence logits,
    target logits, labels), the first three [S, A, G, (V)]."""
    cfg = drafter.config
    s, t = ids.shape
    with torch.no_grad():
        t_logits, feats = target.train_forward(ids, cfg.target_layer_ids)
    pos = torch.randint(0, t - gamma, (s, anchors), generator=gen).to(ids.device)  # anchor positions
    ctx = drafter.project_features(feats)
    ctx_pos = torch.arange(t, device=ids.device).expand(s, t)
    j = ctx_pos[:, None, :]
    visible = (j < pos[..., None]) & (j >= pos[..., None] - cfg.context_window)
    k = torch.arange(gamma, device=ids.device)
    at = pos[..., None] + k  # [S, A, G]: position of block slot k (the anchor is at k = 0)
    rows = torch.arange(s, device=ids.device)[:, None, None]
    prev, labels = ids[rows, at], ids[rows, at + 1]
    d_logits, c_logits = drafter.teacher_forced(ctx, ctx_pos, visible, ids[rows[..., 0], pos], pos, prev, gamma)
    return d_logits, c_logits, t_logits[rows, at], labels


def train_drafter(run: DraftRun, corpus: Corpus | None = None) -> dict:
    torch.manual_seed(run.seed)
    corpus = corpus or Corpus(run.corpus_bytes)
    target = load_model(run.target, dtype=torch.float32, device=run.device, progress=False)
    drafter = K3DSparkDrafter(drafter_config(run, target.config)).to(run.device).bind(target)
    drafter.init_weights(run.seed)
    opt, sched, params = make_optimizer(drafter.parameters(), run.lr, run.steps, run.warmup)
    os.makedirs(run.out, exist_ok=True)
    run_meta = {k: (v if not isinstance(v, LossWeights) else vars(v)) for k, v in vars(run).items()}
    curves = Curves(run.out, "drafter_loss", {"run": run_meta, "corpus": corpus.describe(),
                                               "drafter": drafter.config.to_dict(),
                                               "params": sum(p.numel() for p in params)})
    gen = torch.Generator().manual_seed(run.seed)

    @torch.no_grad()
    def evaluate(step):
        vgen = torch.Generator().manual_seed(run.seed + 1)
        parts = []
        for _ in range(run.eval_batches):
            ids = corpus.batch("val", run.batch_size, run.seq_len, vgen).to(run.device)
            parts.append(dspark_loss(*block_batch(drafter, target, ids, run.anchors, run.block_size, vgen),
                                     run.weights)[1])
        curves.log("val", step, **{k: sum(p[k] for p in parts) / len(parts) for k in parts[0]})

    start = time.time()
    evaluate(0)
    for step in range(1, run.steps + 1):
        ids = corpus.batch("train", run.batch_size, run.seq_len, gen).to(run.device)
        loss, parts = dspark_loss(*block_batch(drafter, target, ids, run.anchors, run.block_size, gen), run.weights)
        parts["grad_norm"] = step_optimizer(opt, sched, params, loss)
        curves.log("train", step, **parts)
        if step % run.eval_every == 0 or step == run.steps:
            evaluate(step)
    drafter.eval().requires_grad_(False)
    save_drafter(drafter, run.out)
    summary = {"seconds": round(time.time() - start, 1), "final_val": curves.data["val"][-1]}
    png = curves.save({"summary": summary})
    return {**summary, "checkpoint": run.out, "curves": curves.path_json, "plot": png}
