"""The launcher calls tools/aot_check.py compiles: each kernel path the 48B decode step takes (real shapes,
batch 1 and 8, PDL on), on CPU tensors (never run: JITFunction.run is replaced by a compile)."""
from __future__ import annotations

import functools

import torch

from k3compile.passes.kernels import (gemv, kda_decode, mla_absorb, mla_decode, moe_decode, moe_launch, norm_gemv,
                                      norm_route, pdl)
from k3compile.passes.kernels import attn_res_norm as arn
from k3compile.passes.kernels import glu_act

for _mod in (gemv, kda_decode, mla_absorb, mla_decode, moe_decode, norm_gemv, norm_route, arn):
    _mod.pdl_for = lambda requested, tensor: bool(requested)  # compile the PDL variants too
G = torch.Generator().manual_seed(0)
BF = torch.bfloat16


def _randn(*shape, dtype=BF):
    return torch.randn(*shape, generator=G).to(dtype)


def kda(batch, **launch):
    from bench_kda_decode import make_layer_inputs
    args = make_layer_inputs(batch, 32, 128, None, False, 1, BF, G, dev="cpu")[0]
    return lambda: kda_decode.fused_kda_decode_triton(*args, use_pdl=True, **launch)


def replay_ssm(batch, layout):
    """P16's verify-inputs kernel and the ReplaySSM fold with the blocks P5's `layout` uses at `batch` (48B shape)."""
    from k3compile.model_def.cache import CacheSpec, CacheTensors
    from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
    from k3compile.passes.kernels.kda_verify_inputs import kda_verify_inputs_triton
    from k3compile.runtime.spec import fold_kernel
    h, kd, length = 32, 128, 4
    c = h * kd
    spec = CacheSpec(n_kda=2, kda_heads=h, kda_head_k=kd, kda_head_v=kd, conv_channels=3 * c, conv_window=3,
                     n_mla=1, kv_width=576, dtype=BF)
    cache = CacheTensors.allocate(spec, batch + 1, 1, 4)
    window = DraftWindow.allocate(DraftWindowSpec(spec, length), batch)
    slots = torch.arange(batch)
    x_k, x_v, f = (_randn(batch, length, c) for _ in range(3))
    conv_w = _randn(c, 4)

    def run():
        kda_verify_inputs_triton(x_k, x_v, conv_w, conv_w, f, torch.zeros(c), torch.zeros(h), _randn(batch, length, h),
                                 cache.conv, 0, slots, window.k, window.v, window.g, window.beta, None,
                                 decode_batch=batch, layout=layout)
        fold_kernel.fold_triton(cache, window, slots, torch.ones(batch, dtype=torch.int32), batch, layout)
    return run


def gemv_case(m, n, k, block_n, block_k, split_k, design, num_warps=4, l2_prefetch_kb=0, early_release=False):
    x, w = _randn(m, k), _randn(n, k)
    return lambda: gemv.gemv_triton(x, w, None, block_n, block_k, split_k, num_warps=num_warps, design=design,
                                    use_pdl=True, l2_prefetch_kb=l2_prefetch_kb, early_release=early_release)


def norm_gemv_case(m, n, k, block_n, block_k, split_k, design, num_warps=4, delta=True):
    x, d, nw, w = _randn(m, k), _randn(m, k) if delta else None, _randn(k), _randn(n, k)
    return lambda: norm_gemv.norm_gemv_triton(x, d, nw, 1e-6, w, None, block_n, block_k, split_k, num_warps=num_warps,
                                              design=design, use_pdl=True)


def mla(batch, with_out, heads=32, gated=False, **launch):
    page, r, rope = 16, 512, 64
    kv = _randn(batch * 32 + 1, 1, page, r + rope)
    table = torch.arange(1, batch * 32 + 1, dtype=torch.int32).view(batch, 32)
    seq = torch.full((batch,), 500, dtype=torch.int32)
    q_nope, q_rope = _randn(batch, heads, r), _randn(batch, heads, rope)
    w_uv = mla_decode.w_uv_of(_randn(heads * 256, r), heads, 128) if with_out else None
    if gated:  # P15's gate_out: a column block of the merged input GEMM's output
        launch["gate"] = _randn(batch, 768 + 576 + heads * 128)[:, 768 + 576:]
    return lambda: mla_decode.decode_triton(q_nope, q_rope, kv, 0, table, seq, 0.07, True, w_uv=w_uv, **launch)


def mla_absorb_case(batch, **launch):
    """P15's absorb_q="triton" at the 48B shape: q_nope a strided view of the [nope + rope] query heads."""
    heads, nope, rope, dv, r = 32, 128, 64, 128, 512
    q = _randn(batch, heads * (nope + rope)).unflatten(-1, (heads, -1))[..., :nope]
    w = _randn(heads * (nope + dv), r)
    return lambda: mla_absorb.absorb_triton(q, w, nope, True, **launch)


def mla_prologue_absorb_case(batch):
    """The prologue + W_UK absorption in one launch (Kimi Linear: no q-LoRA), 48B shape, one merged GEMM output."""
    heads, nope, rope, dv, r, page = 32, 128, 64, 128, 512, 16
    merged = _randn(batch, heads * (nope + rope) + r + rope)
    q = merged[:, : heads * (nope + rope)].unflatten(-1, (heads, -1))[..., :nope]
    kv = _randn(batch * 2 + 1, 2, page, r + rope)
    loc = torch.arange(batch) * 2 * page + page
    return lambda: mla_absorb.prologue_absorb_triton(merged[:, heads * (nope + rope):], _randn(r), 1e-6, kv, 1, loc, q,
                                                     _randn(heads * (nope + dv), r), nope, True)


def route(batch):
    x, delta, w = _randn(batch, 2304), _randn(batch, 2304), torch.ones(2304, dtype=BF)
    router, bias = _randn(256, 2304), torch.zeros(256)
    return lambda: norm_route.norm_route_triton([], x, delta, None, w, 1e-6, 1e-6, bias, router, 8, True, 2.446,
                                                pdl=True)


@functools.lru_cache(maxsize=None)
def _experts(quantized: bool):
    """The 48B layer's expert weights (E=256, I=1024, D=2304), uninitialized: the kernels are compiled, never run,
    and one set (3.6 GB of address space, untouched) serves every case."""
    e, i, d = 256, 1024, 2304
    if not quantized:
        return torch.empty(e, 2 * i, d, dtype=BF), torch.empty(e, d, i, dtype=BF)
    u8 = torch.uint8
    return (torch.empty(e, 2 * i, d // 2, dtype=u8), torch.empty(e, d, i // 2, dtype=u8),
            torch.full((e, 2 * i, d // 32), 127, dtype=u8), torch.full((e, d, i // 32), 127, dtype=u8))


def moe(batch, shared_w13: bool, split=None, **options):
    e, k, i, d = 256, 8, 1024, 2304
    x, (w13, w2) = _randn(batch, d), _experts(False)
    ids, wts = moe_decode.random_routing(batch, e, k, "cpu", seed=1)
    sw13, sw2 = _randn(2 * i, d), _randn(d, i)
    if shared_w13:
        return lambda: moe_decode.fused_moe_triton(x, ids, wts, w13, w2, shared_w2=sw2, shared_w13=sw13, use_pdl=True,
                                                   split=split, **options)
    g, u = _randn(batch, i), _randn(batch, i)
    return lambda: moe_decode.fused_moe_triton(x, ids, wts, w13, w2, shared_in=g, shared_up=u, shared_w2=sw2,
                                               use_pdl=True)


def moe_mxfp4(batch, split=None):
    e, k, i, d = 256, 8, 1024, 2304
    w13, w2, s13, s2 = _experts(True)
    x, sw2 = _randn(batch, d), _randn(d, i)
    ids, wts = moe_decode.random_routing(batch, e, k, "cpu", seed=1)
    g, u = _randn(batch, i), _randn(batch, i)
    return lambda: moe_decode.fused_moe_triton(x, ids, wts, w13, w2, s13, s2, shared_in=g, shared_up=u, shared_w2=sw2,
                                               use_pdl=True, split=split)


CASES = [
    ("kda 48B batch 1 (split 4, prefetch)", kda(1)),
    ("kda 48B batch 1, wait first", kda(1, prefetch=False)),
    ("kda 48B batch 1, early release", kda(1, early_release=True)),
    ("kda 48B batch 8, early release", kda(8, early_release=True)),
    ("kda 48B batch 8 (split 1)", kda(8)),
    ("kda 48B batch 8, 128-column blocks, 8 warps (bench_kda9's sweep)", kda(8, block_v=128, num_warps=8)),
    ("verify inputs + fold 48B batch 1, layout s8", replay_ssm(1, "s8")),
    ("gemv rows o_proj M=1", gemv_case(1, 2304, 4096, 4, 1024, 1, gemv.DESIGNS["rows"])),
    ("gemv rows in_proj M=1", gemv_case(1, 12576, 2304, 16, 256, 1, gemv.DESIGNS["rows"])),
    ("gemv dot o_proj M=8", gemv_case(8, 2304, 4096, 64, 128, 8, gemv.DESIGNS["dot"])),
    # P8's rows warps candidates (kda8's best: 4x1024 w8 at o_proj, 16x256 w4 / w2 at in_proj)
    ("gemv rows o_proj M=1 w8", gemv_case(1, 2304, 4096, 4, 1024, 1, gemv.DESIGNS["rows"], 8)),
    ("gemv rows o_proj M=1 w2 split 4", gemv_case(1, 2304, 4096, 16, 256, 4, gemv.DESIGNS["rows"], 2)),
    ("gemv rows in_proj M=4 w8", gemv_case(4, 12576, 2304, 16, 256, 1, gemv.DESIGNS["rows"], 8)),
    ("gemv rows in_proj M=2 w2", gemv_case(2, 12576, 2304, 4, 1024, 1, gemv.DESIGNS["rows"], 2)),
    # with an L2 prefetch of the weight before gdc_wait (p08_small_m_gemm.l2_prefetch_mb)
    ("gemv rows o_proj M=1 w8 l2pf", gemv_case(1, 2304, 4096, 4, 1024, 1, gemv.DESIGNS["rows"], 8, 32 << 10)),
    ("gemv rows in_proj M=1 l2pf", gemv_case(1, 12576, 2304, 16, 256, 1, gemv.DESIGNS["rows"], 4, 32 << 10)),
    ("gemv rows o_proj M=1 w2 split 4 l2pf", gemv_case(1, 2304, 4096, 16, 256, 4, gemv.DESIGNS["rows"], 2, 16 << 10)),
    ("gemv dot o_proj M=8 l2pf", gemv_case(8, 2304, 4096, 64, 128, 8, gemv.DESIGNS["dot"], 4, 32 << 10)),
    ("gemv rows in_proj M=1 early release", gemv_case(1, 12576, 2304, 16, 256, 1, gemv.DESIGNS["rows"], 4, 0, True)),
    ("gemv rows o_proj M=1 w8 l2pf early release", gemv_case(1, 2304, 4096, 4, 1024, 1, gemv.DESIGNS["rows"], 8,
                                                              32 << 10, True)),
    ("gemv dot o_proj M=8 early release", gemv_case(8, 2304, 4096, 64, 128, 8, gemv.DESIGNS["dot"], 4, 0, True)),
    # P7's norm in the GEMV's prologue (p08_small_m_norm_gemv), at the 48B in_proj / MLP gate-up shapes
    ("norm_gemv rows in_proj M=1", norm_gemv_case(1, 12576, 2304, 16, 256, 1, gemv.DESIGNS["rows"])),
    ("norm_gemv rows in_proj M=1 w2 split 2", norm_gemv_case(1, 12576, 2304, 4, 1024, 2, gemv.DESIGNS["rows"], 2)),
    ("norm_gemv rows in_proj M=4 w8 no delta", norm_gemv_case(4, 12576, 2304, 16, 256, 1, gemv.DESIGNS["rows"], 8,
                                                              delta=False)),
    ("norm_gemv dot in_proj M=8", norm_gemv_case(8, 12576, 2304, 64, 128, 1, gemv.DESIGNS["dot"])),
    ("norm_gemv dot gate_up M=16 split 2", norm_gemv_case(16, 18432, 2304, 64, 128, 2, gemv.DESIGNS["dot"])),
    # P15's q_norm_gemv: K3's q_a norm in the q_b GEMV (k3-mini-6b: 768 -> 16 x 192), no delta
    ("norm_gemv K3 q_b dot M=1", norm_gemv_case(1, 3072, 768, 64, 128, 1, gemv.DESIGNS["dot"], delta=False)),
    ("norm_gemv K3 q_b rows M=1", norm_gemv_case(1, 3072, 768, 16, 256, 1, gemv.DESIGNS["rows"], delta=False)),
    ("mla 48B batch 1 + W_UV (merge cols from the table)", mla(1, True)),
    ("mla 48B batch 4 + W_UV, merge cols 32, 8 splits", mla(4, True, merge_cols=32, num_splits=8)),
    ("mla 48B batch 1 + W_UV, merge cols 128, block_h 32, 8 warps", mla(1, True, merge_cols=128, block_h=32,
                                                                       num_warps=8)),
    ("mla 48B batch 1 + W_UV, whole-row merge", mla(1, True, merge_cols=0)),
    ("mla 48B batch 1 + W_UV, L2 prefetch of W_UV (prefetch_w_uv)", mla(1, True, prefetch_w=True)),
    ("mla 48B batch 4 + W_UV, L2 prefetch of W_UV (prefetch_w_uv)", mla(4, True, prefetch_w=True)),
    ("mla k3-mini-6b batch 1 + W_UV + output gate (gate_out)", mla(1, True, heads=16, gated=True)),
    ("mla k3-mini-6b batch 4 + W_UV + output gate (gate_out)", mla(4, True, heads=16, gated=True)),
    ("mla k3-mini-6b batch 1 + W_UV + output gate, whole-row merge", mla(1, True, heads=16, gated=True, merge_cols=0)),
    ("glu_act situ k3-mini-6b dense MLP batch 1", lambda: glu_act.glu_act_triton(
        *_randn(1, 16384).split(8192, 1), "situ", 4.0, 25.0)),
    ("glu_act silu 48B dense MLP batch 8", lambda: glu_act.glu_act_triton(*_randn(8, 18432).split(9216, 1), "silu",
                                                                          4.0, 25.0)),
    ("mla absorb_q 48B batch 1", mla_absorb_case(1)),
    ("mla absorb_q 48B batch 8", mla_absorb_case(8)),
    ("mla absorb_q 48B batch 1, 128 columns, 8 warps", mla_absorb_case(1, block_r=128, num_warps=8)),
    ("mla absorb_q 48B batch 1, 128 columns, 4 warps", mla_absorb_case(1, block_r=128)),
    ("mla absorb_q 48B batch 1, 32 columns", mla_absorb_case(1, block_r=32)),
    ("mla prologue + absorb_q 48B batch 1", mla_prologue_absorb_case(1)),
    ("mla prologue + absorb_q 48B batch 8", mla_prologue_absorb_case(8)),
    ("mla prologue 48B batch 1 (no q-LoRA)", lambda: mla_decode.prologue_triton(
        _randn(1, 576), _randn(512), 1e-6, _randn(3, 2, 16, 576), 1, torch.tensor([16]), pdl=True)),
    ("mla prologue 48B batch 1 (K3 q-LoRA)", lambda: mla_decode.prologue_triton(
        _randn(1, 576), _randn(512), 1e-6, _randn(3, 2, 16, 576), 1, torch.tensor([16]), _randn(1, 1536),
        _randn(1536), 1e-6, pdl=True)),
    ("mla 48B batch 8 (merge cols from the table)", mla(8, False)),
    ("mla 48B batch 8, whole-row merge", mla(8, False, merge_cols=0)),
    ("norm_route 48B batch 1", route(1)),
    ("norm_route 48B batch 8", route(8)),
    ("moe 48B batch 1", moe(1, False)),
    ("moe 48B batch 8", moe(8, False)),
]
if "shared_w13" in moe_decode.fused_moe_triton.__code__.co_varnames:
    CASES += [("moe 48B batch 1, shared slot in A", moe(1, True))]
# every kernel B' launch tools/bench_moe9.py tries (PDL on)
CASES += [(f"moe 48B batch 1, B' {tuple(c)}", moe(1, True, c)) for c in moe_launch.SPLIT_CANDIDATES]
CASES += [("moe 48B batch 8, B' (64, 128, 4, 2, True)", moe(8, True, moe_launch.SplitConfig(64, 128, 4, 2, True))),
          ("moe 48B MXFP4 batch 1, B' (16, 256, 4, 4, True)", moe_mxfp4(1, moe_launch.SplitConfig(16, 256, 4, 4, True)))]
if "shared_l2_prefetch" in moe_decode.fused_moe_triton.__code__.co_varnames:  # P6's L2 prefetch options (moepf10)
    _pf = dict(shared_l2_prefetch=True, down_l2_prefetch=True)
    CASES += [("moe 48B batch 1, shared slot first + L2 prefetch in A and B'", moe(1, True, **_pf)),
              ("moe 48B batch 8, shared slot first + L2 prefetch in A and B'", moe(8, True, **_pf)),
              ("moe 48B batch 2, B' (64, 128, 4, 2, False) + L2 prefetch in A and B'",
               moe(2, True, moe_launch.SplitConfig(64, 128, 4, 2, False), **_pf)),
              ("moe 48B batch 1, tiles A: shared slot first + L2 prefetch",
               lambda: _moe_tiles_shared(1, shared_l2_prefetch=True, down_l2_prefetch=True))]
CASES += [("moe 48B batch 1, early release (rows A + shared slot first)",
           moe(1, True, shared_l2_prefetch=True, down_l2_prefetch=True, early_release=True)),
          ("moe 48B batch 8, early release", moe(8, True, early_release=True)),
          ("moe 48B batch 1, tiles A: early release", lambda: _moe_tiles_shared(1, early_release=True)),
          ("moe 48B batch 1, B' early release too (the default's L2 options)",
           moe(1, True, shared_l2_prefetch=True, down_l2_prefetch=True, early_release=True, down_early_release=True)),
          ("moe 48B batch 8, B' early release", moe(8, True, down_early_release=True)),
          ("moe 48B MXFP4 batch 1, B' early release (tiles A)", lambda: _moe_tiles_shared(1, down_early_release=True)),
          ("moe 48B batch 1, B' without a shared slot, early release", lambda: _moe_b_plain(1))]


def _moe_b_plain(batch):
    """B' (split) with the shared expert's activated input from outside the op (no shared slot in A)."""
    e, k, i, d = 256, 8, 1024, 2304
    x, (w13, w2) = _randn(batch, d), _experts(False)
    ids, wts = moe_decode.random_routing(batch, e, k, "cpu", seed=1)
    g, u, sw2 = _randn(batch, i), _randn(batch, i), _randn(d, i)
    moe_decode.fused_moe_triton(x, ids, wts, w13, w2, shared_in=g, shared_up=u, shared_w2=sw2, use_pdl=True,
                                designs=("rows", "split"), down_early_release=True)


def _moe_tiles_shared(batch, **options):
    """Kernel A's "tiles" design (MXFP4 routed experts) with its shared slot, PDL on, and the op's `options`."""
    e, k, i, d = 256, 8, 1024, 2304
    w13, w2, s13, s2 = _experts(True)
    x, sw13, sw2 = _randn(batch, d), _randn(2 * i, d), _randn(d, i)
    ids, wts = moe_decode.random_routing(batch, e, k, "cpu", seed=1)
    moe_decode.fused_moe_triton(x, ids, wts, w13, w2, s13, s2, shared_w2=sw2, shared_w13=sw13, use_pdl=True, **options)


@functools.lru_cache(maxsize=None)
def _mini_experts():
    """k3-mini-6b's latent MoE expert weights (E=96, I=512, latent 1024), uninitialized (compiled, never run)."""
    return torch.empty(96, 2 * 512, 1024, dtype=BF), torch.empty(96, 1024, 512, dtype=BF)


def moe_mini(batch, rows=None, split=None, latent=None, **options):
    """The op as P6 emits it for k3-mini-6b (latent path: A rows, B' split, C with norm, up-projection to 2048 and the
    shared expert's GLU, Is = 1024), PDL on; A's and C's launches put in through ROWS_TUNED / LATENT_TUNED."""
    e, k, i, lat, d, s = 96, 8, 512, 1024, 2048, 1024
    (w13, w2), x = _mini_experts(), _randn(batch, lat)
    ids, wts = moe_decode.random_routing(batch, e, k, "cpu", seed=1)
    g, u, sw2, upw, nw = _randn(batch, s), _randn(batch, s), _randn(d, s), _randn(d, lat), _randn(lat)
    entries = [(moe_launch.ROWS_TUNED, ("up", batch * k, i, lat), rows), (moe_launch.LATENT_TUNED, (batch, d, lat, s),
                                                                           latent)]

    def run():
        for table, key, launch in entries:
            if launch is not None:
                table[key] = launch
        try:
            moe_decode.fused_moe_triton(x, ids, wts, w13, w2, shared_in=g, shared_up=u, shared_w2=sw2, act="situ",
                                        latent_up_w=upw, latent_norm_w=nw, use_pdl=True, designs=("rows", "split"),
                                        split=split, **options)
        finally:
            for table, key, launch in entries:
                table.pop(key, None)
    return run


# every launch tools/bench_moe10mini.py tries (k3-mini-6b, PDL on)
for _b in (1, 8):
    CASES += [(f"moe mini batch {_b} (today's launches)", moe_mini(_b))]
    CASES += [(f"moe mini batch {_b}, A {c}", moe_mini(_b, rows=c)) for c in moe_launch.ROWS_CANDIDATES]
    CASES += [(f"moe mini batch {_b}, B' {tuple(c)}", moe_mini(_b, split=c))
              for c in moe_launch.LATENT_SPLIT_CANDIDATES]
    CASES += [(f"moe mini batch {_b}, C {tuple(c)}", moe_mini(_b, latent=c)) for c in moe_launch.LATENT_CANDIDATES]

if "target_programs" in gemv.rows_configs.__code__.co_varnames:  # P8's rows_programs candidates, k3-mini shapes
    for _n in (2048, 8336):
        for _p in (132, 264, 1056):
            CASES += [(f"gemv rows k3-mini N={_n} rows_programs {_p} {c[:3]}", gemv_case(1, _n, 2048, *c))
                      for c in gemv.rows_configs(_n, 2048, _p)]

if "routed_l2_prefetch" in moe_decode.fused_moe_triton.__code__.co_varnames:  # P6's routed_l2_prefetch (B' routed)
    _rel = dict(early_release=True, down_early_release=True, routed_l2_prefetch=True)
    CASES += [("moe mini batch 1, routed L2 prefetch in B'", moe_mini(1, latent_prewait=True, **_rel)),
              ("moe 48B batch 1, routed L2 prefetch in B'", moe(1, True, shared_l2_prefetch=True,
                                                                down_l2_prefetch=True, **_rel))]

if "latent_prewait" in moe_decode.fused_moe_triton.__code__.co_varnames:  # P6's latent_prewait (tools/gpu_mini13.sh)
    for _b in (1, 8):  # batch 1: C's W_up tile before the wait too (one K step); 8: the shared expert only
        CASES += [(f"moe mini batch {_b}, latent_prewait + early releases",
                   moe_mini(_b, early_release=True, down_early_release=True, latent_prewait=True))]

if "up_prewait" in moe_decode.fused_moe_triton.__code__.co_varnames:  # P6's up_prewait (kernel A, session 20)
    for _b in (1, 8):
        CASES += [(f"moe mini batch {_b}, up_prewait + latent_prewait + early releases",
                   moe_mini(_b, early_release=True, down_early_release=True, latent_prewait=True, up_prewait=True))]
    CASES += [("moe mini batch 1, up_prewait, A (8, 1024, 4): the whole K before the wait",
               moe_mini(1, rows=(8, 1024, 4), early_release=True, down_early_release=True, latent_prewait=True,
                        up_prewait=True))]

try:  # p07_moe_out_norm's kernel C with the AttnRes norm tail (tools/gpu_mini14.sh), k3-mini-6b, PDL on
    from k3compile.passes.kernels import moe_out_norm
except ImportError:
    moe_out_norm = None


def moe_mini_norm(batch, bank_rows=8, tail_warps=0, tail_block_n=0, **options):
    """The op as p07_moe_out_norm emits it for k3-mini-6b: moe_mini's MoE, then the norm (a bank of `bank_rows` rows
    of 2048, the residual add) as kernel C's tail."""
    e, k, i, lat, d, s = 96, 8, 512, 1024, 2048, 1024
    (w13, w2), x = _mini_experts(), _randn(batch, lat)
    ids, wts = moe_decode.random_routing(batch, e, k, "cpu", seed=1)
    g, u, sw2, upw, nw = _randn(batch, s), _randn(batch, s), _randn(d, s), _randn(d, lat), _randn(lat)
    bank, res, query, norm_w = [_randn(batch, d) for _ in range(bank_rows)], _randn(batch, d), _randn(d), _randn(d)
    return lambda: moe_out_norm.fused_moe_norm_triton(
        bank, res, query.float(), norm_w, 1e-6, 1e-5, x, ids, wts, w13, w2, None, None, g, u, sw2, "situ", 4.0, 25.0,
        upw, nw, 1e-5, None, tail_warps=tail_warps, tail_block_n=tail_block_n, use_pdl=True, designs=("rows", "split"), **options)


if moe_out_norm is not None:
    for _b in (1, 8):
        CASES += [(f"moe_out_norm mini batch {_b}", moe_mini_norm(_b)),
                  (f"moe_out_norm mini batch {_b}, tail_warps 8", moe_mini_norm(_b, tail_warps=8)),
                  (f"moe_out_norm mini batch {_b}, tail_block_n 8", moe_mini_norm(_b, tail_block_n=8)),
                  (f"moe_out_norm mini batch {_b}, tail_block_n 8 + latent_prewait + early releases",
                   moe_mini_norm(_b, tail_block_n=8, early_release=True, down_early_release=True,
                                 latent_prewait=True)),
                  (f"moe_out_norm mini batch {_b}, latent_prewait + early releases",
                   moe_mini_norm(_b, early_release=True, down_early_release=True, latent_prewait=True))]
    CASES += [("moe_out_norm mini batch 1, no bank", moe_mini_norm(1, bank_rows=0))]

if "flag_deps" in moe_decode.fused_moe_triton.__code__.co_varnames:  # tools/bench_moe11.py's arms (48B, PDL on)
    _p6 = dict(shared_l2_prefetch=True, down_l2_prefetch=True)  # as P6 emits the op
    for _b in (1, 8):
        CASES += [(f"moe 48B batch {_b}, A {c}", moe(_b, True, up_launch=c, **_p6))
                  for c in moe_launch.FULL_ROWS_CANDIDATES]
        CASES += [(f"moe 48B batch {_b}, flag_deps", moe(_b, True, flag_deps=True, **_p6))]
        CASES += [(f"moe 48B batch {_b}, flag_deps B' {tuple(c)}", moe(_b, True, c, flag_deps=True, **_p6))
                  for c in moe_launch.FLAG_SPLIT_CANDIDATES]
    CASES += [("moe 48B MXFP4 batch 1, flag_deps (tiles A, B' 2 chunks)",
               lambda: _moe_tiles_shared(1, split=moe_launch.SplitConfig(4, 512, 4, 2), flag_deps=True))]


def route_launch(batch, shape="48b", tail="rounds", target_programs=norm_route.TARGET_PROGRAMS):
    """P7's norm_route kernel with a routing tail and grid target (its options): 48B (D=2304, no bank, E=256 top-8)
    or k3-mini-6b (D=2048, a 4-row AttnRes bank, E=96 top-8)."""
    dim, rows, experts = (2304, 0, 256) if shape == "48b" else (2048, 4, 96)
    bank, x, delta = [_randn(batch, dim) for _ in range(rows)], _randn(batch, dim), _randn(batch, dim)
    query, w = (_randn(dim, dtype=torch.float32) if rows else None), torch.ones(dim, dtype=BF)
    router, bias = _randn(experts, dim), torch.zeros(experts)
    return lambda: norm_route.norm_route_triton(bank, x, delta, query, w, 1e-6, 1e-6, bias, router, 8, True, 2.446,
                                                pdl=True, tail=tail, target_programs=target_programs)


def route_front_case(batch, tail="bitonic", front_block=None):
    """norm_route_gemv's launch at k3-mini-6b (D=2048, a 4-row AttnRes bank, E=96 top-8, front rows 2048: latent
    1024 + shared gate/up 2 x 512): the router's programs plus the front GEMV's (pass p08_small_m_route_gemv)."""
    dim = 2048
    bank, x, delta = [_randn(batch, dim) for _ in range(4)], _randn(batch, dim), _randn(batch, dim)
    query, w = _randn(dim, dtype=torch.float32), torch.ones(dim, dtype=BF)
    router, bias, front = _randn(96, dim), torch.zeros(96), _randn(2048, dim)
    return lambda: norm_route.norm_route_triton(bank, x, delta, query, w, 1e-6, 1e-6, bias, router, 8, True, 2.446,
                                                pdl=True, tail=tail, front_weight=front, front_block=front_block)


if "front_weight" in norm_route.norm_route_triton.__code__.co_varnames:
    CASES += [(f"norm_route_gemv mini batch {_b}", route_front_case(_b)) for _b in (1, 8)]
    CASES += [(f"norm_route_gemv mini batch 1, front_block {_f}", route_front_case(1, front_block=_f)) for _f in (4, 8)]


if "tail" in norm_route.norm_route_triton.__code__.co_varnames:  # route11: every launch tools/bench_route11.py times
    from bench_route11 import ARMS as _ROUTE11_ARMS
    CASES += [(f"norm_route {_s} batch {_b}, {_name}", route_launch(_b, _s, **_arm))
              for _s in ("48b", "mini") for _b in (1, 8) for _name, _arm in _ROUTE11_ARMS.items()]

try:  # the sorted M-tiled experts above P6's crossover (kernels/moe_sorted.py): every launch bench_moe_sorted.py times
    from bench_moe_sorted import VARIANTS as _SORTED_VARIANTS

    from k3compile.passes.kernels import moe_sorted

    def sorted_case(shape, batch, launch):
        e, i, d, act = (96, 512, 1024, "situ") if shape == "mini" else (256, 1024, 2304, "silu")
        w13, w2, x = torch.empty(e, 2 * i, d, dtype=BF), torch.empty(e, d, i, dtype=BF), _randn(batch, d)
        ids, wts = moe_decode.random_routing(batch, e, 8, "cpu", seed=1)
        return lambda: moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0, launch)
    CASES += [(f"moe sorted {_s} batch 64, {_name}", sorted_case(_s, 64, _l))
              for _s in ("mini", "48b") for _name, _l in _SORTED_VARIANTS.items()]

    def sorted_mxfp4_case(batch):
        w13, w2, s13, s2 = _experts(True)
        ids, wts = moe_decode.random_routing(batch, 256, 8, "cpu", seed=1)
        return lambda: moe_sorted.moe_experts_sorted(_randn(batch, 2304), ids, wts, w13, w2, "silu", 4.0, 25.0,
                                                     w13_scale=s13, w2_scale=s2)
    CASES += [("moe sorted 48b MXFP4 batch 64", sorted_mxfp4_case(64))]

    def sorted_finish_case(batch, norm):
        e, i, d = 96, 512, 1024
        w13, w2, x = torch.empty(e, 2 * i, d, dtype=BF), torch.empty(e, d, i, dtype=BF), _randn(batch, d)
        ids, wts = moe_decode.random_routing(batch, e, 8, "cpu", seed=1)
        return lambda: moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, "situ", 4.0, 25.0, finish=True,
                                                     norm_w=_randn(d) if norm else None)
    CASES += [(f"moe sorted mini batch 64, finish, norm {_n}", sorted_finish_case(64, _n)) for _n in (False, True)]
except ImportError:
    pass


def _gemv_chain(m, widths, block_n, block_k, backoff_ns=0, persistent=False):
    from k3compile.passes.kernels.gemv_chain import GemvChain
    return lambda: GemvChain([_randn(widths[i + 1], widths[i]) for i in range(len(widths) - 1)], m, block_n,
                             block_k, num_warps=4 if m == 1 else 8, backoff_ns=backoff_ns,
                             persistent=persistent).launch()


# tools/bench_gemv_chain.py's launches: S dependent GEMVs in one launch (tickets, in-kernel waits)
CASES += [(f"gemv chain k3-mini 2048 x8 M={m} {bn}x{bk}", _gemv_chain(m, (2048,) * 9, bn, bk))
          for m in (1, 4) for bn, bk in ((4, 1024), (8, 512), (16, 256))]
CASES += [("gemv chain k3-mini 2048 x8 M=1 4x1024 sleeps", _gemv_chain(1, (2048,) * 9, 4, 1024, 128))]
CASES += [(f"gemv chain k3-mini 2048 x8 M={m} {bn}x{bk} persistent", _gemv_chain(m, (2048,) * 9, bn, bk, 0, True))
          for m in (1, 4) for bn, bk in ((4, 1024), (2, 2048))]
CASES += [(f"gemv chain k3-mini 2048 x8 M={m} 2x2048", _gemv_chain(m, (2048,) * 9, 2, 2048)) for m in (1, 4)]
