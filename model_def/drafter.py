"""DSpark block drafter (spec §5.1-5.2): proposes a block of gamma tokens in one forward.

Block input: the anchor (last committed token) then gamma-1 `mask_token_id`s, at absolute positions
t .. t+gamma-1. Output k predicts the token at t+k+1. Each drafter layer attends non-causally over
[context ; block]: the context is the target's features (model.py FEATURES) of positions < t from
`target_layer_ids`, concatenated, projected (`fc`) and normed (`hidden_norm`); the block is the
layer's own hidden states. Rotary positions on queries and keys give the block its order.

Heads on top of the base logits U_k = lm_head(norm(h_k)) (the target's LM head, shared):
* Markov head: B_k = W2 W1[x_{k-1}] (W1 = `markov_embed` [V, r], W2 = `markov_proj` r -> V), where
  x_{-1} is the anchor and x_{k-1} the previous draft token; p_d(.|k) = softmax(U_k + B_k). The only
  serial part, and cheap.
* Confidence head: c_k = sigmoid(Linear([h_k ; W1[x_{k-1}]])), the probability that token k is
  accepted given that all earlier block tokens were.

The target's `embed_tokens` and `lm_head` are bound, not owned: they are not parameters of this
module and never appear in its checkpoint.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .drafter_config import DrafterConfig
from .layers.common import RMSNorm, linear


def rotary(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding: x [..., L, H, D], pos [..., L] (absolute positions)."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.float().unsqueeze(-1) * inv  # [..., L, half]
    cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.heads, self.head_dim, self.theta = h, hd, cfg.rope_theta
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj, self.k_proj, self.v_proj = linear(d, h * hd), linear(d, h * hd), linear(d, h * hd)
        self.o_proj = linear(h * hd, d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj, self.up_proj = linear(d, cfg.intermediate_size), linear(d, cfg.intermediate_size)
        self.down_proj = linear(cfg.intermediate_size, d)

    def forward(self, x, ctx, x_pos, ctx_pos, mask):
        """x [S, Q, D] block hidden, ctx [S, C, D] projected context, mask [S, Q, C + Q] (True = attend)."""
        hd = (self.heads, self.head_dim)
        h = self.input_layernorm(x)
        kv_in = torch.cat([ctx, h], 1)
        kv_pos = torch.cat([ctx_pos, x_pos], 1)
        q = rotary(self.q_proj(h).unflatten(-1, hd), x_pos, self.theta)
        k = rotary(self.k_proj(kv_in).unflatten(-1, hd), kv_pos, self.theta)
        v = self.v_proj(kv_in).unflatten(-1, hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask.unsqueeze(1))
        x = x + self.o_proj(o.transpose(1, 2).flatten(-2))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class K3DSparkDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = linear(cfg.feature_size, d)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_embed = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_proj = linear(cfg.markov_rank, cfg.vocab_size)
        conf_in = d + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.confidence_head = nn.Linear(conf_in, 1)
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # a tuple: not registered as submodules

    # ---- the target's shared pieces ----
    def bind(self, target) -> "K3DSparkDrafter":
        """Use `target`'s (a K3ForCausalLM) embedding and LM head; checks that the shapes agree."""
        self.config.check_target(target.config)
        self._shared = (target.model.embed_tokens, target.lm_head)
        return self

    def _target(self):
        if self._shared is None:
            raise RuntimeError("the drafter is not bound to a target: call drafter.bind(target) first")
        return self._shared

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """N(0, std) weights, unit norms; the Markov bias starts at zero (the drafter starts as a pure
        parallel drafter) and the confidence head at bias 0 (c = 0.5)."""
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            elif name.startswith("markov_proj") or name == "confidence_head.bias":
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)

    # ---- the forward ----
    def project_features(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., F] -> context rows [..., D] (what the per-request caches keep)."""
        if feats.shape[-1] != self.config.feature_size:
            raise ValueError(f"features have width {feats.shape[-1]}, the drafter expects "
                             f"{self.config.feature_size} ({len(self.config.target_layer_ids)} layers x "
                             f"{self.config.hidden_size})")
        return self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))

    def block_hidden(self, ctx, ctx_pos, ctx_visible, anchors, anchor_pos, gamma: int) -> torch.Tensor:
        """One parallel forward for A blocks per sequence.

        ctx [S, C, D] projected context rows, ctx_pos [S, C] their positions, ctx_visible [S, A, C] which
        rows block a may read (positions before its anchor); anchors [S, A] token ids at anchor_pos [S, A].
        Returns the final-normed hidden states [S, A, gamma, D]."""
        cfg = self.config
        if not 1 <= gamma <= cfg.block_size:
            raise ValueError(f"gamma must be in 1..{cfg.block_size} (the drafter's block_size), got {gamma}")
        embed, _ = self._target()
        s, a = anchors.shape
        ids = torch.full((s, a, gamma), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        x = embed(ids).to(self.fc.weight.dtype).flatten(1, 2)  # [S, A*G, D]
        x_pos = (anchor_pos.unsqueeze(-1) + torch.arange(gamma, device=anchors.device)).flatten(1)
        same_block = torch.eye(a, dtype=torch.bool, device=anchors.device).repeat_interleave(gamma, 0)
        same_block = same_block.repeat_interleave(gamma, 1)  # [A*G, A*G]: non-causal inside a block only
        mask = torch.cat([ctx_visible.repeat_interleave(gamma, 1), same_block.expand(s, -1, -1)], -1)
        for layer in self.layers:
            x = layer(x, ctx, x_pos, ctx_pos, mask)
        return self.norm(x).unflatten(1, (a, gamma))

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U_k = target lm_head(h_k), fp32."""
        _, lm_head = self._target()
        return lm_head(hidden.to(lm_head.weight.dtype)).float()

    def markov(self, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias B [..., V] fp32, the low-rank code W1[x_{k-1}] [..., r]) for the previous tokens."""
        code = self.markov_embed(prev_tokens)
        return self.markov_proj(code).float(), code

    def confidence_logit(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        inp = torch.cat([hidden, code.to(hidden.dtype)], -1) if self.config.confidence_with_markov else hidden
        return self.confidence_head(inp).squeeze(-1).float()

    def teacher_forced(self, ctx, ctx_pos, ctx_visible, anchors, anchor_pos, prev_tokens, gamma: int):
        """Training view: block logits and confidence logits with the true previous tokens fed to the
        Markov / confidence heads (prev_tokens [S, A, G]: anchor, then the true tokens of the block).
        Returns (draft logits [S, A, G, V] = U + B, confidence logits [S, A, G])."""
        h = self.block_hidden(ctx, ctx_pos, ctx_visible, anchors, anchor_pos, gamma)
        bias, code = self.markov(prev_tokens)
        return self.base_logits(h) + bias, self.confidence_logit(h, code)

    @torch.no_grad()
    def draft(self, ctx, ctx_pos, ctx_visible, anchors, anchor_pos, gamma: int, temperatures: torch.Tensor,
              generator: torch.Generator | None = None):
        """Propose one block per row (A = 1): ctx [B, C, D]; anchors [B]; temperatures [B] (0 = greedy).

        Returns (tokens [B, G] int64, probs [B, G, V] fp32 the distribution each token was drawn from
        (one-hot rows for greedy), confidence [B, G] fp32)."""
        h = self.block_hidden(ctx, ctx_pos, ctx_visible, anchors[:, None], anchor_pos[:, None], gamma)[:, 0]
        base = self.base_logits(h)  # [B, G, V]
        b = anchors.shape[0]
        greedy = temperatures <= 0
        temps = torch.where(greedy, torch.ones_like(temperatures), temperatures).float()[:, None]
        tokens = torch.empty(b, gamma, dtype=torch.long, device=anchors.device)
        probs = torch.empty_like(base)
        conf = torch.empty(b, gamma, dtype=torch.float32, device=anchors.device)
        prev = anchors
        for k in range(gamma):  # the serial part: the Markov bias depends on the previous draft token
            bias, code = self.markov(prev)
            logits = base[:, k] + bias
            p = torch.softmax(logits / temps, -1)
            sampled = torch.multinomial(p, 1, generator=generator).squeeze(1) if not bool(greedy.all()) else None
            tok = logits.argmax(-1) if sampled is None else torch.where(greedy, logits.argmax(-1), sampled)
            p = torch.where(greedy[:, None], F.one_hot(tok, p.shape[-1]).float(), p)
            tokens[:, k], probs[:, k] = tok, p
            conf[:, k] = torch.sigmoid(self.confidence_logit(h[:, k], code))
            prev = tok
        return tokens, probs, conf
