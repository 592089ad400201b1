"""A whole model vs the same model split over gloo ranks: greedy generation through the step contract
(two prefill chunks, so the second continues over a prefix that other DCP ranks hold, then decode)."""
from __future__ import annotations

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.config import get_preset
from k3compile.model_def.init import init_random
from k3compile.model_def.loader import build_model

PAGE = 4
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 41, 9, 300, 11], [260, 4, 33, 12, 90]]
STEPS = 4


def wide_config(name: str, heads: int = 8):
    """The tiny preset with enough heads to split 8 ways (the presets have 2)."""
    return get_preset(name).replace(kda_num_heads=heads, num_attention_heads=heads)


def whole_model(cfg, seed: int = 0):
    model = build_model(cfg, torch.float32, "cpu")
    init_random(model, seed)
    return model


def greedy(model, prompts=PROMPTS, steps=STEPS, kv_shard=None, decode_calls: list | None = None):
    """Tokens [B, steps] and the logits of every step ([B, V] each) from whole prompts. `decode_calls`
    receives the collectives of the last decode step (comm.record() entries)."""
    from k3compile.model_def.parallel import comm

    m = 1 if kv_shard is None else kv_shard[1]
    device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else model.device
    b = len(prompts)
    longest = max(len(p) for p in prompts) + steps
    pages = -(-(-(-longest // m)) // PAGE)
    cache = CacheTensors.allocate(model.cache_spec(torch.float32), b + 1, b * pages + 1, PAGE, device)
    rows = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(b)]
    slots = list(range(1, b + 1))
    split = [len(p) // 2 for p in prompts]
    def batch(mode, toks, prefix):
        return ForwardBatch.build(mode, toks, prefix, rows, slots, PAGE, device=device, kv_shard=kv_shard)

    model.step(batch("prefill", [p[:s] for p, s in zip(prompts, split)], [0] * b), cache)
    logits = model.step(batch("prefill", [p[s:] for p, s in zip(prompts, split)], split), cache)
    lens = [len(p) for p in prompts]
    tokens, all_logits = [], [logits]
    for step in range(steps):
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        if step == steps - 1:
            break
        with comm.record() as calls:
            logits = model.step(batch("decode", [[t] for t in nxt], lens), cache)
        if decode_calls is not None:
            decode_calls[:] = calls
        all_logits.append(logits)
        lens = [n + 1 for n in lens]
    return torch.tensor(tokens).t(), torch.stack(all_logits).cpu()


def dcp_decode_vs_full(seq, dcp, heads, width, rank_r, page, scale, device="cpu", seed=0):
    """Absorbed MLA decode over a whole paged cache vs the same rows split by position over `dcp` shards
    (local row p // dcp on shard p mod dcp), attended per shard and LSE-merged.
    Returns (merged [B, H, r], full [B, H, r], per-shard lse [dcp, B, H])."""
    from k3compile.model_def.ops.attention_math import mla_decode_latent
    from k3compile.model_def.parallel.dcp_attention import latent_partial
    from k3compile.model_def.parallel.lse_merge import merge_partials

    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = -(-max(seq) // page)
    rows = [torch.randn(n, width, generator=g, device=device) for n in seq]
    q = torch.randn(len(seq), heads, width, generator=g, device=device)
    table = torch.tensor([[1 + i * pages_per + j for j in range(pages_per)] for i in range(len(seq))], device=device)

    def paged(per_request):
        kv = torch.zeros(1 + len(seq) * pages_per, page, width, device=device)
        for i, x in enumerate(per_request):
            kv.view(-1, width)[table[i, 0] * page: table[i, 0] * page + len(x)] = x
        return kv

    seq_t = torch.tensor(seq, device=device)
    full = mla_decode_latent(q, paged(rows), table, seq_t, scale, rank_r)
    cu = torch.arange(len(seq) + 1, device=device)
    parts = [latent_partial(q, paged([x[d::dcp] for x in rows]), table, cu, seq_t, scale, rank_r, d, dcp)
             for d in range(dcp)]
    lses = torch.stack([p[1] for p in parts])
    merged, _ = merge_partials(torch.stack([p[0] for p in parts]), lses)
    return merged, full, lses
