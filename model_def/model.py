"""The Kimi-Linear / K3 decoder as code: one module tree, three entry points sharing the layers.

* `forward(input_ids [B, T]) -> logits [B, T, V]`: full sequences from an empty cache (parity).
* `prefill(batch, cache)`: a chunk of new tokens per request, continuing from KV pages + state slots.
* `decode(batch, cache)`: one token for each of B requests with different context lengths.

The residual stream is either the plain pre-norm residual (Kimi Linear) or Block Attention
Residuals (K3, spec §0.1 / §3.2): a running partial sum p plus a bank of block sums, read through
a learned softmax before every sub-layer and once more before the final norm.
"""
from __future__ import annotations

import torch
from torch import nn

from .batch import ForwardBatch
from .cache import CacheSpec, CacheTensors
from .config import ModelConfig
from .draft_window import VERIFY_MODES, WINDOW_MODES, DraftWindow
from .layers.attn_res import attn_res_read
from .layers.common import RMSNorm, StepInputs
from .layers.kda import KDAMixer
from .layers.mla import MLAMixer
from .layers.moe import GLUMLP, MoE
from .ops.eager_dispatch import k3


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, pool_index: int, shard=None):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.shard = shard
        self.self_attn = KDAMixer(cfg, pool_index, shard) if self.kind == "kda" else MLAMixer(cfg, pool_index, shard)
        if cfg.is_moe_layer(i):
            self.block_sparse_moe = MoE(cfg, shard)
        else:
            self.mlp = GLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg, shard)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            d = cfg.hidden_size
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, cfg.rms_norm_eps)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x)
        y = self.mlp(x)
        return y if self.shard is None else k3.all_reduce(y, "world")


class K3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, shard=None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kda_i = mla_i = 0
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, i, kda_i if kind == "kda" else mla_i, shard))
            kda_i, mla_i = kda_i + (kind == "kda"), mla_i + (kind == "mla")
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, s: StepInputs, feature_layers: tuple[int, ...] = ()):
        """Final hidden [N, D]; with `feature_layers`, also their features [N, len * D] (see `FEATURES`)."""
        bad = [i for i in feature_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"feature_layers {bad} out of range: the model has {len(self.layers)} layers")
        x = self.embed_tokens(input_ids)
        feats: dict[int, torch.Tensor] = {}
        if self.cfg.attn_res_block_size is None:
            for i, layer in enumerate(self.layers):
                x = x + layer.self_attn(layer.input_layernorm(x), s)
                x = x + layer.ffn(layer.post_attention_layernorm(x))
                feats[i] = x
            h = self.norm(x)
        else:
            h = self._forward_attn_res(x, s, feats)
        if not feature_layers:
            return h
        return h, torch.cat([feats[i] for i in feature_layers], -1)

    def _forward_attn_res(self, emb: torch.Tensor, s: StepInputs, feats: dict) -> torch.Tensor:
        eps, block = self.cfg.rms_norm_eps, self.cfg.attn_res_block_size
        bank: list[torch.Tensor] = []
        p = emb
        for i, layer in enumerate(self.layers):
            a = attn_res_read(bank + [p], layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, eps)
            if i > 0:
                feats[i - 1] = a  # what layer i reads is the feature of layer i - 1 (FEATURES)
            if i % block == 0:  # block boundary: the finished partial sum becomes a bank row
                bank.append(p)
                p = torch.zeros_like(p)
            p = p + layer.self_attn(layer.input_layernorm(a), s)
            a = attn_res_read(bank + [p], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
            p = p + layer.ffn(layer.post_attention_layernorm(a))
        out = attn_res_read(bank + [p], self.output_attn_res_proj.weight, self.output_attn_res_norm.weight, eps)
        feats[len(self.layers) - 1] = out
        return self.norm(out)


class K3ForCausalLM(nn.Module):
    """`shard` (a parallel.topology.RankShard) builds one rank of a parallel engine: its blocks of heads,
    columns, experts and vocabulary, with k3::all_reduce / all_gather / all_to_all where partial results
    meet. Without one the model is whole and issues no collective."""

    def __init__(self, cfg: ModelConfig, shard=None):
        super().__init__()
        self.config = cfg
        self.shard = shard
        self.model = K3Model(cfg, shard)
        vocab = cfg.vocab_size if shard is None else len(shard.block(cfg.vocab_size))  # lm_head split by vocab
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings and shard is None:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- step contract ----
    def cache_spec(self, dtype: torch.dtype | None = None, tp_size: int | None = None) -> CacheSpec:
        if tp_size is None:
            tp_size = 1 if self.shard is None else self.shard.world
        return CacheSpec.from_config(self.config, dtype or self.lm_head.weight.dtype, tp_size)

    def step(self, batch: ForwardBatch, cache: CacheTensors, window: DraftWindow | None = None,
             feature_layers: tuple[int, ...] = ()):
        """Run one prefill / decode / verify step; returns logits [M, V] for `batch.logits_indices` (fp32).

        Verify ("verify": ReplaySSM, "verify_snapshot": the baseline) runs n tokens per request (anchor +
        drafts; the same n for all) as n decode queries each (MLA appends KV as prefill does), but leaves the KDA state slots and conv windows as they
        are and fills `window` (row i = request i); `draft_window.commit_reference` or the runtime's
        fold then keeps the accepted prefix. With `feature_layers`, returns (logits, features [N, len * D])
        for every packed token."""
        if batch.mode not in ("prefill", "decode") + VERIFY_MODES:
            raise ValueError(f"unsupported step mode {batch.mode!r}")
        extra = ()
        if batch.mode in VERIFY_MODES:
            if window is None or WINDOW_MODES[batch.mode] != window.spec.kind:
                raise ValueError(f"a {batch.mode!r} step needs a {WINDOW_MODES[batch.mode]!r} draft window")
            if len(set(batch.extend_lens_cpu)) > 1:
                raise ValueError(f"a verify step takes the same number of tokens for every request, got "
                                 f"{batch.extend_lens_cpu} (the executor pads shorter ones)")
            if batch.batch_size > window.rows or max(batch.extend_lens_cpu or [0]) > window.spec.length:
                raise ValueError(f"verify batch ({batch.batch_size} requests, up to {max(batch.extend_lens_cpu)} "
                                 f"tokens each) exceeds the draft window ({window.rows} x {window.spec.length})")
            extra = window.tensors()
        return self.step_tensors(batch.mode, batch.input_ids, batch.cu_seqlens, batch.seq_lens, batch.page_table,
                                 batch.state_slots, batch.out_cache_loc, batch.logits_indices, cache.ssm,
                                 cache.conv, cache.kv, *extra, feature_layers=feature_layers)

    def step_tensors(self, mode, input_ids, cu_seqlens, seq_lens, page_table, state_slots, out_cache_loc,
                     logits_indices, ssm, conv, kv, *window, feature_layers: tuple[int, ...] = ()):
        """The step as a function of tensors only: this is what the compiler captures. `window`: the
        draft window's tensors in verify modes."""
        s = StepInputs(mode, cu_seqlens, seq_lens, page_table, state_slots, out_cache_loc, ssm, conv, kv, window)
        # a decode step has one token per request and wants every row's logits (ForwardBatch checks both), so
        # its gather would be the identity: left out, it is one launch fewer in the captured decode step
        rows = (lambda h: h) if mode == "decode" else (lambda h: h[logits_indices])
        if not feature_layers:
            logits = self.lm_head(rows(self.model(input_ids, s))).float()
            if self.shard is None:
                return logits
            return k3.all_gather(logits, "world", self.shard.world, -1)
        if self.shard is not None:
            raise NotImplementedError("drafter feature layers are not supported on a rank of a parallel model yet")
        h, feats = self.model(input_ids, s, feature_layers)
        return self.lm_head(rows(h)).float(), feats

    def train_forward(self, input_ids: torch.Tensor, feature_layers: tuple[int, ...] = ()):
        """Differentiable full-sequence forward for training: input_ids [B, T] -> logits [B, T, V] (fp32),
        each sequence from an empty state, no cache. With `feature_layers`: (logits, features [B, T, F])."""
        b, t = input_ids.shape
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=input_ids.device)
        out = self.model(input_ids.reshape(-1), StepInputs("train", cu), feature_layers)
        h, feats = out if feature_layers else (out, None)
        logits = self.lm_head(h).float().view(b, t, -1)
        return logits if feats is None else (logits, feats.view(b, t, -1))

    def prefill(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        return self._step_as("prefill", batch, cache)

    def decode(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        return self._step_as("decode", batch, cache)

    def _step_as(self, mode: str, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        if batch.mode != mode:
            raise ValueError(f"{mode}() was given a {batch.mode!r} batch")
        return self.step(batch, cache)

    # ---- full sequences (parity) ----
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V], from an empty cache (uses a throwaway cache)."""
        b, t = input_ids.shape
        page = 16
        pages_per_req = (t + page - 1) // page
        cache = CacheTensors.allocate(self.cache_spec(), b + 1, b * pages_per_req + 1, page,
                                      device=input_ids.device)
        rows = [list(range(1 + i * pages_per_req, 1 + (i + 1) * pages_per_req)) for i in range(b)]
        batch = ForwardBatch.build("prefill", input_ids.tolist(), [0] * b, rows, list(range(1, b + 1)), page,
                                   device=input_ids.device, logits="all")
        return self.step(batch, cache).view(b, t, -1)
