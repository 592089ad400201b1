"""Fused MoE decode (k3::fused_moe_decode): the reference is the unfused composition, argument errors,
the Triton kernels under the interpreter on CPU, the op's traceability, and on CUDA at the
Kimi-Linear-48B MoE shape (bf16 and MXFP4 experts, both sides of the crossover)."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.model_def.config import get_preset
from k3compile.model_def.ops import mxfp4
from k3compile.model_def.ops.moe_math import glu_act, moe_experts_loop
from k3compile.passes.kernels import moe_decode, moe_launch
from k3compile.passes.kernels.moe_decode import fused_moe_reference, random_routing

from .interpreted import run_interpreted

FUSED = torch.ops.k3.fused_moe_decode.default


def _problem(n=3, e=8, k=2, d=64, i=32, do=48, s=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ids, wts = random_routing(n, e, k, "cpu", seed)
    return dict(x=torch.randn(n, d, generator=gen).to(dtype), topk_ids=ids, topk_weights=wts,
                w13=(torch.randn(e, 2 * i, d, generator=gen) * d ** -0.5).to(dtype),
                w2=(torch.randn(e, do, i, generator=gen) * i ** -0.5).to(dtype),
                shared_in=torch.randn(n, s, generator=gen).to(dtype), shared_up=torch.randn(n, s, generator=gen).to(dtype),
                shared_w2=(torch.randn(do, s, generator=gen) * s ** -0.5).to(dtype))


def _op_args(p, act="situ", crossover=16, w13_scale=None, w2_scale=None):
    return (p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"], w13_scale, w2_scale, p.get("shared_in"),
            p.get("shared_up"), p.get("shared_w2"), act, 4.0, 25.0, crossover)


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_reference_is_the_unfused_composition(act):
    p = _problem()
    want = moe_experts_loop(p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"], act, 4.0, 25.0)
    want = want + F.linear(glu_act(p["shared_in"], p["shared_up"], act, 4.0, 25.0), p["shared_w2"])
    assert torch.equal(FUSED(*_op_args(p, act)), want)
    # the shared input already activated
    activated = glu_act(p["shared_in"], p["shared_up"], act, 4.0, 25.0)
    args = list(_op_args(p, act))
    args[7], args[8] = activated, None
    assert torch.equal(FUSED(*args), want)


def test_mxfp4_reference_runs_on_dequantized_weights():
    p = _problem()
    w13p, w13s = mxfp4.quantize(p["w13"])
    w2p, w2s = mxfp4.quantize(p["w2"])
    got = fused_moe_reference(p["x"], p["topk_ids"], p["topk_weights"], w13p, w2p, w13s, w2s, act="silu")
    want = moe_experts_loop(p["x"], p["topk_ids"], p["topk_weights"], mxfp4.dequantize(w13p, w13s),
                            mxfp4.dequantize(w2p, w2s), "silu", 4.0, 25.0)
    assert torch.equal(got, want)
    # and it is close to the unquantized experts (MXFP4 keeps ~2 significant bits per weight)
    dense = moe_experts_loop(p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"], "silu", 4.0, 25.0)
    assert (got - dense).abs().max() < 0.35 * dense.abs().max()


def test_bad_arguments_raise_clear_errors():
    p = _problem()
    cases = [
        (dict(act="gelu"), "unknown activation 'gelu'"),
        (dict(topk_ids=p["topk_ids"][:2]), "must both be \\[tokens = 3, k\\]"),
        (dict(topk_ids=p["topk_ids"].float()), "topk_ids must be integer"),
        (dict(w13=p["w13"][:, :, :32]), "x width 64 != expert input width 32"),
        (dict(w2=p["w2"][:, :, :16]), "w13 \\[E, 2I, D\\] and w2 \\[E, Do, I\\]"),
        (dict(shared_in=p["shared_in"][:, :8]), "shared_in must be \\[3, 16\\]"),
        (dict(shared_w2=None), "given without shared_w2"),
        (dict(w13=p["w13"].to(torch.uint8)), "float expert weights expected"),
        (dict(w13_scale=torch.zeros(8, 64, 2, dtype=torch.uint8)), "both MXFP4 scale tensors"),
    ]
    for change, message in cases:
        q = dict(p, act="situ")
        q.update(change)
        args = (q["x"], q["topk_ids"], q["topk_weights"], q["w13"], q["w2"], q.get("w13_scale"), q.get("w2_scale"),
                q["shared_in"], q["shared_up"], q["shared_w2"], q["act"], 4.0, 25.0, 16)
        with pytest.raises(ValueError, match=message):
            FUSED(*args)
    w13p, w13s = mxfp4.quantize(p["w13"])
    w2p, w2s = mxfp4.quantize(p["w2"])
    with pytest.raises(mxfp4.MXFP4FormatError, match="scales have shape"):
        fused_moe_reference(p["x"], p["topk_ids"], p["topk_weights"], w13p, w2p, w13s[..., :1], w2s)


def test_shared_gate_up_weight_is_the_merged_gemm_then_split():
    """shared_w13 [2 Is, D]: the op computes the shared expert's gate/up as P1's merged GEMM + split would."""
    p = _problem()
    gen = torch.Generator().manual_seed(3)
    sw13 = torch.randn(2 * p["shared_w2"].shape[1], p["x"].shape[1], generator=gen) * 0.1
    gate, up = (p["x"] @ sw13.t()).split(sw13.shape[0] // 2, dim=1)
    for act in ("silu", "situ"):
        want = FUSED(*_op_args(dict(p, shared_in=gate, shared_up=up), act))
        got = FUSED(*_op_args(dict(p, shared_in=None, shared_up=None), act), None, None, 1e-5, False, sw13)
        assert torch.equal(got, want)
    torch.library.opcheck(FUSED, (*_op_args(dict(p, shared_in=None, shared_up=None)), None, None, 1e-5, False, sw13))
    bad = [(dict(shared_in=p["shared_in"]), sw13, "shared_w13 or as shared_in / shared_up, not both"),
           (dict(shared_w2=None), sw13, "shared_w13 needs shared_w2"),
           ({}, sw13[:, :32], "shared_w13 must be \\[2 Is, D\\] = \\[32, 64\\]"),
           ({}, sw13.double(), "in x's dtype torch.float32")]
    for change, weight, message in bad:
        q = {**p, "shared_in": None, "shared_up": None, **change}
        with pytest.raises(ValueError, match=message):
            FUSED(*_op_args(q), None, None, 1e-5, False, weight)
    with pytest.raises(ValueError, match="full-width MoE"):  # a latent MoE's shared expert does not read x
        fused_moe_reference(p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"], shared_w2=p["shared_w2"],
                            latent_up_w=torch.randn(48, 48), shared_w13=sw13)


def test_shared_slot_of_kernel_a_under_interpreter_matches_reference():
    run_interpreted("interpret_moe_shared_slot.py", timeout=600)


def test_triton_kernels_under_interpreter_match_reference():
    run_interpreted("interpret_moe_decode.py", timeout=900)


def test_split_down_projection_under_interpreter_matches_reference_and_repeats_bit_for_bit():
    run_interpreted("interpret_moe_down_split.py", timeout=600)


def test_kernel_designs_follow_the_measured_rule_and_rows_refuses_mxfp4():
    # as measured on the H200 (the table in moe_decode.py): bf16/fp32 "rows" up, MXFP4 "tiles" up, "split" down
    assert moe_launch.kernel_designs(1, False) == ("rows", "split")
    assert moe_launch.kernel_designs(8, False) == ("rows", "split")
    assert moe_launch.kernel_designs(64, True) == ("tiles", "split")
    assert moe_launch.kernel_designs(0, False) == ("rows", "split")  # an empty batch takes the smallest entry
    # the tables are what the lead edits after measuring: an entry applies from its batch on
    saved = dict(moe_launch.DENSE_DESIGNS)
    try:
        moe_launch.DENSE_DESIGNS.update({4: ("tiles", "tiles"), 8: ("rows", "rows")})
        assert [moe_launch.kernel_designs(b, False) for b in (1, 3, 4, 7, 8)] == [
            ("rows", "split"), ("rows", "split"), ("tiles", "tiles"), ("tiles", "tiles"), ("rows", "rows")]
    finally:
        moe_launch.DENSE_DESIGNS.clear()
        moe_launch.DENSE_DESIGNS.update(saved)
    if moe_decode.triton is None:
        return
    p = _problem(n=2)
    w13p, w13s = mxfp4.quantize(p["w13"])
    w2p, w2s = mxfp4.quantize(p["w2"])
    with pytest.raises(ValueError, match="rows.*dense weights"):
        moe_decode.fused_moe_triton(p["x"], p["topk_ids"], p["topk_weights"], w13p, w2p, w13s, w2s,
                                    designs=("rows", "tiles"))
    with pytest.raises(ValueError, match="unknown kernel design"):
        moe_decode.fused_moe_triton(p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"],
                                    designs=("rows", "fast"))
    with pytest.raises(ValueError, match="unknown kernel design 'split'"):  # a down-projection design only
        moe_decode.fused_moe_triton(p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"],
                                    designs=("split", "tiles"))


def test_split_launch_comes_from_the_table_and_bad_launches_raise():
    """Kernel B''s launch: SPLIT_TUNED's entry for a listed shape, else the tile rule with one K chunk and no
    prefetch; a bad SplitConfig is refused before anything launches."""
    key = (9, 2304, 1024, False)  # 48B, batch 1: 8 routed slots + the shared one
    assert moe_launch.split_config(*key) == moe_launch.SPLIT_TUNED[key]
    other = moe_launch.split_config(3, 48, 32, False)
    assert tuple(other[:3]) == moe_launch.gemv_config("split", 3, 48, 32, False) and other[3:] == (1, False)
    p = _problem()
    for bad, message in (((64, 100, 4), "split block_k must be a power of two"), ((3, 128, 4), "split block_n"),
                         ((64, 128, 4, 0), "k_split must be >= 1"), ((64, 128, 6, 1), "split num_warps")):
        with pytest.raises(ValueError, match=message):
            moe_decode.fused_moe_triton(*_op_args(p)[:13], designs=("rows", "split"), split=bad)


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the launch, runs nothing."""

    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, tuple(grid), kwargs))


@pytest.mark.skipif(moe_decode.triton is None, reason="needs triton")
def test_l2_prefetch_options_reach_the_launches(monkeypatch):
    """shared_l2_prefetch: kernel A's grid transposed (shared slot first) whenever asked and the slot exists; its L2
    prefetch (PIECES = 32 x num_warps) only with PDL and 16-byte rows; down_l2_prefetch: B''s shared slot, likewise.
    Off, and above moe_launch.L2_PREFETCH_MAX_TOKENS tokens: the launches are today's (no new constexprs). Kernels
    replaced by recorders: launch arguments only."""
    launches = []
    for name in ("_expert_up_rows_kernel", "_expert_up_kernel", "_expert_down_split_kernel"):
        monkeypatch.setattr(moe_decode, name, _Recorder(launches, name))
    pdl = {"on": False}
    monkeypatch.setattr(moe_decode, "pdl_for", lambda requested, tensor: bool(requested) and pdl["on"])

    def launch(d=64, s=32, dtype=torch.bfloat16, up="rows", n=1, **options):
        p = _problem(n=n, e=8, k=3, d=d, i=32, do=48, s=s, dtype=dtype)
        sw13 = torch.randn(2 * s, d).to(dtype)
        launches.clear()
        moe_decode.fused_moe_triton(*_op_args(dict(p, shared_in=None, shared_up=None))[:13], shared_w13=sw13,
                                    use_pdl=True, designs=(up, "split"), **options)
        (a_name, a_grid, a_kw), (b_name, _, b_kw) = launches
        assert a_name == f"_expert_up{'_rows' if up == 'rows' else ''}_kernel" and b_name == "_expert_down_split_kernel"
        return a_grid, a_kw, b_kw

    a_grid, a_kw, b_kw = launch()
    today, blocks = a_grid, a_grid[1]  # (tokens x (k + 1) slots, column blocks)
    assert a_grid[0] == 1 * 4 and "SHARED_FIRST" not in a_kw and "SHARED_L2_PREFETCH" not in b_kw
    a_grid, a_kw, b_kw = launch(shared_l2_prefetch=True, down_l2_prefetch=True)  # no PDL: the order only
    assert a_grid == today[::-1] and a_kw["SHARED_FIRST"] and not a_kw["SHARED_L2_PREFETCH"]
    assert "SHARED_L2_PREFETCH" not in b_kw
    pdl["on"] = True
    for up in ("rows", "tiles"):
        a_grid, a_kw, b_kw = launch(up=up, shared_l2_prefetch=True, down_l2_prefetch=True)
        assert a_grid == launch(up=up)[0][::-1]
        a_grid, a_kw, b_kw = launch(up=up, shared_l2_prefetch=True, down_l2_prefetch=True)
        assert a_kw["SHARED_FIRST"] and a_kw["SHARED_L2_PREFETCH"] and a_kw["PIECES"] == 32 * a_kw["num_warps"]
        assert b_kw["SHARED_L2_PREFETCH"] and b_kw["PIECES"] == 32 * b_kw["num_warps"] and b_kw["launch_pdl"]
    assert moe_launch.L2_PREFETCH_MAX_TOKENS == 1  # two tokens: both options asked for, today's launches
    a_grid, a_kw, b_kw = launch(n=2, shared_l2_prefetch=True, down_l2_prefetch=True)
    assert a_grid == launch(n=2)[0] and "SHARED_FIRST" not in a_kw and "SHARED_L2_PREFETCH" not in b_kw
    a_grid, a_kw, b_kw = launch(down_l2_prefetch=True)  # B' alone
    assert "SHARED_FIRST" not in a_kw and b_kw["SHARED_L2_PREFETCH"]
    # rows that are not whole 16-byte units (D = 60, Is = 36 bf16): no prefetch, the order stays as asked
    a_grid, a_kw, b_kw = launch(d=60, s=36, shared_l2_prefetch=True, down_l2_prefetch=True)
    assert a_kw["SHARED_FIRST"] and not a_kw["SHARED_L2_PREFETCH"] and "SHARED_L2_PREFETCH" not in b_kw
    # without the shared slot in A (shared_in / shared_up given) the option changes nothing in A
    p = _problem(n=2, e=8, k=3, d=64, i=32, do=48, s=32, dtype=torch.bfloat16)
    launches.clear()
    moe_decode.fused_moe_triton(*_op_args(p)[:13], use_pdl=True, designs=("rows", "split"), shared_l2_prefetch=True)
    assert launches[0][1] == (2 * 3, blocks) and "SHARED_FIRST" not in launches[0][2]


def test_op_passes_opcheck_and_stays_one_node():
    p = _problem(n=2)
    torch.library.opcheck(FUSED, _op_args(p))
    w13p, w13s = mxfp4.quantize(p["w13"])
    w2p, w2s = mxfp4.quantize(p["w2"])
    torch.library.opcheck(FUSED, _op_args(dict(p, w13=w13p, w2=w2p), "silu", 16, w13s, w2s))

    def fn(x, ids, wts, w13, w2):
        return FUSED(x, ids, wts, w13, w2, None, None, None, None, None, "silu", 4.0, 25.0, 8)

    graph = make_fx(fn, tracing_mode="symbolic")(p["x"], p["topk_ids"], p["topk_weights"], p["w13"], p["w2"])
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert calls == [FUSED]


# ------------------------------------------------------------------------------------- CUDA

def _shape_48b():
    cfg = get_preset("kimi-linear-48b")
    return dict(e=cfg.num_experts, k=cfg.num_experts_per_token, d=cfg.hidden_size, i=cfg.moe_intermediate_size,
                do=cfg.hidden_size, s=cfg.moe_intermediate_size * cfg.num_shared_experts)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _cuda_problem(n, seed, e, k, d, i, do, s):
    """bf16 tensors made on the GPU (the 48B experts are 2.4 GB: too slow to make on the host)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    ids, wts = random_routing(n, e, k, "cuda", seed)
    return dict(x=randn(n, d), topk_ids=ids, topk_weights=wts, w13=randn(e, 2 * i, d, scale=d ** -0.5),
                w2=randn(e, do, i, scale=i ** -0.5), shared_in=randn(n, s), shared_up=randn(n, s),
                shared_w2=randn(do, s, scale=s ** -0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("n", [1, 8, 64])
def test_cuda_op_at_the_48b_shape_matches_reference(quant, n):
    p = _cuda_problem(n, n, **_shape_48b())
    scales = (None, None)
    if quant:
        w13p, w13s = mxfp4.quantize(p["w13"])
        w2p, w2s = mxfp4.quantize(p["w2"])
        p.update(w13=w13p, w2=w2p)
        scales = (w13s, w2s)
    for act in ("silu", "situ"):
        # reference: the unfused composition in fp32 (on the GPU, host-synchronizing expert loop)
        f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in p.items()}
        ref = fused_moe_reference(*_op_args(f32, act, 0, *scales)[:13])
        for crossover in (1 << 30, 1):  # the Triton GEMVs, then the grouped-GEMM path
            got = FUSED(*_op_args(p, act, crossover, *scales))
            assert got.dtype == torch.bfloat16 and got.shape == ref.shape
            err = _rel(got, ref)
            assert err < 1e-2, (act, crossover, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_latent_tail_at_the_k3_mini_shape(quant, n):
    """K3-style layer (k3-mini-6b): experts on the latent, RMSNorm + up-projection + shared expert in kernel C."""
    cfg = get_preset("k3-mini-6b")
    d, lat = cfg.hidden_size, cfg.latent_size
    s = cfg.moe_intermediate_size * cfg.num_shared_experts
    p = _cuda_problem(n, n, e=cfg.num_experts, k=cfg.num_experts_per_token, d=lat, i=cfg.moe_intermediate_size,
                      do=lat, s=s)
    gen = torch.Generator(device="cuda").manual_seed(99)
    p["shared_w2"] = (torch.randn(d, s, generator=gen, device="cuda") * s ** -0.5).bfloat16()
    up_w = (torch.randn(d, lat, generator=gen, device="cuda") * lat ** -0.5).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(lat, generator=gen, device="cuda")).bfloat16()
    scales = (None, None)
    if quant:
        (w13p, w13s), (w2p, w2s) = mxfp4.quantize(p["w13"]), mxfp4.quantize(p["w2"])
        p.update(w13=w13p, w2=w2p)
        scales = (w13s, w2s)
    f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in p.items()}
    ref = fused_moe_reference(*_op_args(f32, "situ", 0, *scales)[:13], up_w.float(), norm_w.float(), 1e-5)
    for crossover in (1 << 30, 1):
        got = FUSED(*_op_args(p, "situ", crossover, *scales), up_w, norm_w, 1e-5)
        assert got.shape == (n, d) and _rel(got, ref) < 1e-2, (crossover, _rel(got, ref))
    for down in [d for d in moe_launch.DOWN_DESIGNS if not (quant and d == "rows")]:  # "rows": dense weights only
        got = moe_decode.fused_moe_triton(*_op_args(p, "situ", 0, *scales)[:13], up_w, norm_w, 1e-5,
                                          designs=("tiles" if quant else "rows", down))
        assert _rel(got, ref) < 1e-2, (down, _rel(got, ref))


def _k3_mini_latent_problem(n, seed, tail_seed):
    """k3-mini-6b's latent MoE at batch n on the GPU, bf16: the op's inputs (routed experts and the shared expert's
    down-projection) with the latent up-projection and norm weights; and the generator, for more inputs."""
    cfg = get_preset("k3-mini-6b")
    d, lat = cfg.hidden_size, cfg.latent_size
    s = cfg.moe_intermediate_size * cfg.num_shared_experts
    p = _cuda_problem(n, seed, e=cfg.num_experts, k=cfg.num_experts_per_token, d=lat, i=cfg.moe_intermediate_size,
                      do=lat, s=s)
    gen = torch.Generator(device="cuda").manual_seed(tail_seed)
    p["shared_w2"] = (torch.randn(d, s, generator=gen, device="cuda") * s ** -0.5).bfloat16()
    up_w = (torch.randn(d, lat, generator=gen, device="cuda") * lat ** -0.5).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(lat, generator=gen, device="cuda")).bfloat16()
    return p, up_w, norm_w, gen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_latent_prewait_gives_the_same_bits_at_the_k3_mini_shape(n):
    """latent_prewait (kernel C: the shared expert's down-projection, and at batch 1 the W_up tile, before gdc_wait)
    at k3-mini-6b's latent MoE shape, PDL on, with and without A's and B''s early release (B' then releases C right
    after its own wait): eager and replayed from CUDA graphs behind another kernel, outputs bit-identical with the
    option off, and within the reference's tolerance."""
    p, up_w, norm_w, _ = _k3_mini_latent_problem(n, 800 + n, 801)
    f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in p.items()}
    ref = fused_moe_reference(*_op_args(f32, "situ", 0)[:13], up_w.float(), norm_w.float(), 1e-5)
    args = (*_op_args(p, "situ", 0)[:13], up_w, norm_w, 1e-5)
    off = moe_decode.fused_moe_triton(*args, use_pdl=True)
    for early, down in ((False, False), (True, False), (True, True)):
        on = moe_decode.fused_moe_triton(*args, use_pdl=True, early_release=early, down_early_release=down,
                                         latent_prewait=True)
        torch.cuda.synchronize()
        assert torch.equal(on, off), (early, down)
    assert _rel(off, ref) < 1e-2, _rel(off, ref)
    scratch = torch.empty(1 << 22, device="cuda")
    graphs = []
    for early, down, pre in ((True, False, False), (True, False, True), (True, True, True)):
        def step(early=early, down=down, pre=pre):
            scratch.mul_(0.5)
            out = FUSED(*_op_args(p, "situ", 1 << 30), up_w, norm_w, 1e-5, True, None, None, True, True, None, False,
                        early, down, pre)
            return out * 1.0  # the kernel after the op
        graphs.append(_graphed(step))
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(graphs[0][1], g[1]) for g in graphs[1:])
    assert _rel(graphs[0][1], ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, up_launch", [(1, None), (1, (8, 1024, 4)), (8, None)])
def test_cuda_up_prewait_reads_final_ids_behind_an_early_released_front_gemv(n, up_launch):
    """up_prewait (kernel A reads its expert and first K step of rows before gdc_wait) at k3-mini-6b's latent MoE
    shape, as the engine runs it: new routing written by one kernel, then the front GEMV (PDL, early release) making
    x, then the op, replayed from a CUDA graph on routing it has not seen. Bit-identical to the option off on the same
    routing (a stale id read before the wait would not be), and within the reference's tolerance."""
    from k3compile.passes.kernels import gemv as gemv_kernels
    cfg = get_preset("k3-mini-6b")
    d, lat = cfg.hidden_size, cfg.latent_size
    p, up_w, norm_w, gen = _k3_mini_latent_problem(n, 810 + n, 811)
    w_front = (torch.randn(lat, d, generator=gen, device="cuda") * d ** -0.5).bfloat16()
    h = torch.randn(n, d, generator=gen, device="cuda").bfloat16()
    routings = [random_routing(n, cfg.num_experts, cfg.num_experts_per_token, "cuda", seed=812 + r)[0]
                for r in range(3)]
    ids = routings[0].clone()
    options = dict(use_pdl=True, early_release=True, down_early_release=True, latent_prewait=True,
                   up_launch=up_launch)
    rows = n <= gemv_kernels.ROWS_MAX_M  # the front's launch as P8 may pick it: rows design up to 4 rows, else dot
    front = (4, 1024, 1, 4, gemv_kernels.DESIGNS["rows"]) if rows else (64, 128, 1, 4, gemv_kernels.DESIGNS["dot"])

    def step(pre):
        ids.copy_(routing_in)  # the router's kernel
        x = gemv_kernels.gemv_triton(h, w_front, None, *front, use_pdl=True,
                                     early_release=True)  # the front GEMV, releasing A early
        return moe_decode.fused_moe_triton(x, ids, p["topk_weights"], p["w13"], p["w2"], None, None, p["shared_in"],
                                           p["shared_up"], p["shared_w2"], "situ", 4.0, 25.0, up_w, norm_w, 1e-5,
                                           up_prewait=pre, **options)
    routing_in = routings[0].clone()
    graphs = [_graphed(lambda pre=pre: step(pre)) for pre in (False, True)]
    for r in routings[1:]:
        routing_in.copy_(r)
        for graph, _ in graphs:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphs[0][1], graphs[1][1])
        x = torch.mm(h.float(), w_front.float().t()).bfloat16().float()
        f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in p.items()}
        ref = fused_moe_reference(x, r, f32["topk_weights"], f32["w13"], f32["w2"], None, None, f32["shared_in"],
                                  f32["shared_up"], f32["shared_w2"], "situ", 4.0, 25.0, up_w.float(), norm_w.float(),
                                  1e-5)
        assert _rel(graphs[1][1], ref) < 1e-2, _rel(graphs[1][1], ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["k3-mini-6b", "kimi-linear-48b"])
def test_cuda_routed_l2_prefetch_gives_the_same_bits(name):
    """routed_l2_prefetch (B''s routed slots ask L2 for their W2 rows before gdc_wait) at batch 1 with today's
    releases, eager and in a CUDA graph behind another kernel: bit-identical to the option off."""
    cfg = get_preset(name)
    lat = cfg.latent_size or cfg.hidden_size
    p = _cuda_problem(1, 900, e=cfg.num_experts, k=cfg.num_experts_per_token, d=lat, i=cfg.moe_intermediate_size,
                      do=lat, s=cfg.moe_intermediate_size)
    args = _op_args(p, "situ", 1 << 30)
    releases = dict(use_pdl=True, early_release=True, down_early_release=True)
    off = moe_decode.fused_moe_triton(*args[:13], **releases)
    on = moe_decode.fused_moe_triton(*args[:13], **releases, routed_l2_prefetch=True)
    torch.cuda.synchronize()
    assert torch.equal(on, off)
    scratch = torch.empty(1 << 22, device="cuda")
    graphs = []
    for prefetch in (False, True):
        def step(prefetch=prefetch):
            scratch.mul_(0.5)
            return FUSED(*args, None, None, 1e-5, True, None, None, True, True, None, False, True, True, False, False,
                         False, prefetch) * 1.0
        graphs.append(_graphed(step))
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphs[0][1], graphs[1][1]) and torch.equal(graphs[0][1], off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_crossover_measurement_returns_a_tried_batch():
    shape = _shape_48b()
    p = _cuda_problem(1, 0, **shape)
    crossover, timings = moe_decode.measure_crossover(p["w13"], p["w2"], shared_w2=p["shared_w2"], top_k=shape["k"],
                                                      batches=(1, 64, 256))
    assert crossover in (1, 64, 256, moe_decode.NO_CROSSOVER)
    assert all(t["fused_us"] > 0 and t["grouped_us"] > 0 for t in timings.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_pdl_and_other_tiles_at_the_48b_shape(n):
    """The GEMV kernels launched with PDL, and with tiles other than the rule's (what a TUNED entry or the
    bench's sweep sets), still match the reference; bf16 and MXFP4 experts."""
    p = _cuda_problem(n, 100 + n, **_shape_48b())
    (w13p, w13s), (w2p, w2s) = mxfp4.quantize(p["w13"]), mxfp4.quantize(p["w2"])
    for quant in (False, True):
        q = dict(p, w13=w13p, w2=w2p) if quant else p
        scales = (w13s, w2s) if quant else (None, None)
        f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in q.items()}
        ref = fused_moe_reference(*_op_args(f32, "silu", 0, *scales)[:13])
        got = FUSED(*_op_args(q, "silu", 1 << 30, *scales), None, None, 1e-5, True)  # use_pdl
        assert _rel(got, ref) < 1e-2, ("pdl", quant, _rel(got, ref))
        for block_n, block_k, warps in ((16, 64, 8), (4, 512, 4)):
            got = moe_decode.fused_moe_triton(*_op_args(q, "silu", 0, *scales)[:13], block_k=block_k,
                                              block_n=block_n, num_warps=warps, use_pdl=True)
            assert _rel(got, ref) < 1e-2, (block_n, block_k, warps, quant, _rel(got, ref))
        # every (up, down) design pair, not only the one kernel_designs picks at this batch (dense weights)
        for designs in ([] if quant else [(u, d) for u in moe_launch.DESIGNS for d in moe_launch.DOWN_DESIGNS]):
            got = moe_decode.fused_moe_triton(*_op_args(q, "silu", 0, *scales)[:13], designs=designs)
            assert _rel(got, ref) < 1e-2, (designs, _rel(got, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_split_down_projection_at_the_48b_shape(n):
    """The "split" down-projection (kernel B') at the 48B shape, bf16 and MXFP4 experts, with and without
    the shared expert, PDL off and on, its own tile and two others: matches the reference, repeats bit for bit
    (the partials are summed in slot order, whatever order the programs finish in) and leaves the arrival
    counters zero (CUDA-graph replays need no memset)."""
    from k3compile.passes.kernels import arrivals
    p = _cuda_problem(n, 200 + n, **_shape_48b())
    (w13p, w13s), (w2p, w2s) = mxfp4.quantize(p["w13"]), mxfp4.quantize(p["w2"])
    for quant in (False, True):
        q = dict(p, w13=w13p, w2=w2p) if quant else p
        scales = (w13s, w2s) if quant else (None, None)
        up = "tiles" if quant else "rows"
        for shared in (True, False):
            r = q if shared else {key: v for key, v in q.items() if not key.startswith("shared")}
            f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in r.items()}
            ref = fused_moe_reference(*_op_args(f32, "silu", 0, *scales)[:13])
            for tile, pdl in (((None, None), False), ((None, None), True), ((8, 128), True), ((64, 256), False)):
                got, again = (moe_decode.fused_moe_triton(*_op_args(r, "silu", 0, *scales)[:13], block_n=tile[0],
                                                          block_k=tile[1], use_pdl=pdl, designs=(up, "split"))
                              for _ in range(2))
                torch.cuda.synchronize()
                assert _rel(got, ref) < 1e-2, (quant, shared, tile, pdl, _rel(got, ref))
                assert torch.equal(got, again), (quant, shared, tile, pdl)
                assert not arrivals.current(got.device, moe_decode.ARRIVALS_OWNER).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_split_launch_candidates_at_the_48b_shape(n):
    """Every launch of kernel B' that tools/bench_moe9.py may make the default (SPLIT_CANDIDATES: tiles, K chunks
    per slot, prefetch of the next W2 tile), PDL on, with kernel A's shared slot as the engine runs the op, bf16;
    and MXFP4 experts with K chunks: matches the reference, repeats bit for bit, leaves the counters zero."""
    from k3compile.passes.kernels import arrivals
    base = _cuda_problem(n, 500 + n, **_shape_48b())
    p, sw13 = _with_shared_w13(base, 500 + n)
    f32 = {key: (v.float() if v is not None and v.dtype == torch.bfloat16 else v) for key, v in p.items()}
    ref = fused_moe_reference(*_op_args(f32, "silu", 0)[:13], shared_w13=sw13.float())
    for split in moe_launch.SPLIT_CANDIDATES:
        got, again = (moe_decode.fused_moe_triton(*_op_args(p, "silu", 0)[:13], shared_w13=sw13,
                                                  use_pdl=True, designs=("rows", "split"), split=split)
                      for _ in range(2))
        torch.cuda.synchronize()
        assert _rel(got, ref) < 1e-2, (split, _rel(got, ref))
        assert torch.equal(got, again), split
        assert not arrivals.current(got.device, moe_decode.ARRIVALS_OWNER).any()
    q = {key: v for key, v in base.items() if not key.startswith("shared")}
    (w13p, w13s), (w2p, w2s) = mxfp4.quantize(q["w13"]), mxfp4.quantize(q["w2"])
    q = dict(q, w13=w13p, w2=w2p)
    f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in q.items()}
    ref = fused_moe_reference(*_op_args(f32, "silu", 0, w13s, w2s)[:13])
    for split in (moe_launch.SplitConfig(4, 512, 4, 2), moe_launch.SplitConfig(16, 256, 4, 4, True)):
        got = moe_decode.fused_moe_triton(*_op_args(q, "silu", 0, w13s, w2s)[:13], use_pdl=True,
                                          designs=("tiles", "split"), split=split)
        assert _rel(got, ref) < 1e-2, ("mxfp4", split, _rel(got, ref))


def _graphed(fn):
    """(CUDA graph of fn, its output buffer); fn runs once first: compiles and allocates the shared counters
    outside the capture."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [None, (64, 128, 4, 2, True)])
def test_cuda_split_down_projection_replays_from_a_cuda_graph(split):
    """Captured once, replayed on new routing: each replay matches the reference (the counters were zero); B' at
    its table's launch and with K chunks + prefetch."""
    shape = _shape_48b()
    p = _cuda_problem(2, 300, **shape)
    args = list(_op_args(p, "silu", 0)[:13])
    graph, out = _graphed(lambda: moe_decode.fused_moe_triton(*args, designs=("rows", "split"), use_pdl=True,
                                                              split=split))
    for seed in (1, 2, 3):
        ids, wts = random_routing(2, shape["e"], shape["k"], "cuda", seed)
        p["topk_ids"].copy_(ids)
        p["topk_weights"].copy_(wts)
        graph.replay()
        f32 = {key: (v.float() if v.dtype == torch.bfloat16 else v) for key, v in p.items()}
        ref = fused_moe_reference(*_op_args(f32, "silu", 0)[:13])
        assert _rel(out, ref) < 1e-2, (seed, _rel(out, ref))


def _with_shared_w13(p, seed):
    """p with the shared expert's gate/up as a [2 Is, D] weight for kernel A's shared slot (no shared_in/up)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s, d = p["shared_w2"].shape[1], p["x"].shape[1]
    sw13 = (torch.randn(2 * s, d, generator=gen, device="cuda") * d ** -0.5).bfloat16()
    return dict(p, shared_in=None, shared_up=None), sw13


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_shared_slot_of_kernel_a_at_the_48b_shape(n):
    """The shared expert's gate/up in kernel A (shared_w13) at the 48B shape: every (up, down) design pair with
    bf16 experts and the MXFP4 tiles design, PDL off and on, SiLU and SiTU, vs the fp32 reference."""
    p, sw13 = _with_shared_w13(_cuda_problem(n, 400 + n, **_shape_48b()), n)
    (w13p, w13s), (w2p, w2s) = mxfp4.quantize(p["w13"]), mxfp4.quantize(p["w2"])
    for quant in (False, True):
        q = dict(p, w13=w13p, w2=w2p) if quant else p
        scales = (w13s, w2s) if quant else (None, None)
        f32 = {key: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
               for key, v in q.items()}
        designs = [("tiles", d) for d in ("tiles", "split")] if quant else \
            [(u, d) for u in moe_launch.DESIGNS for d in moe_launch.DOWN_DESIGNS]
        for act in ("silu", "situ"):
            ref = fused_moe_reference(*_op_args(f32, act, 0, *scales)[:13], shared_w13=sw13.float())
            got = FUSED(*_op_args(q, act, 1 << 30, *scales), None, None, 1e-5, True, sw13)  # the op, PDL on
            assert _rel(got, ref) < 1e-2, ("op", quant, act, _rel(got, ref))
            for up, down in designs:
                for pdl in (False, True):
                    got = moe_decode.fused_moe_triton(*_op_args(q, act, 0, *scales)[:13], shared_w13=sw13,
                                                      designs=(up, down), use_pdl=pdl)
                    assert _rel(got, ref) < 1e-2, (quant, act, up, down, pdl, _rel(got, ref))
            got = FUSED(*_op_args(q, act, 1, *scales), None, None, 1e-5, False, sw13)  # the grouped-GEMM path
            assert _rel(got, ref) < 1e-2, ("grouped", quant, act, _rel(got, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_shared_slot_with_pdl_replays_from_a_cuda_graph(n):
    """Kernel A with the shared slot and B' launched with PDL, captured once in a CUDA graph (as the engine
    runs them) and replayed on new routings and inputs: each replay matches the reference."""
    shape = _shape_48b()
    p, sw13 = _with_shared_w13(_cuda_problem(n, 500 + n, **shape), 7)
    args = list(_op_args(p, "silu", 0)[:13])
    graph, out = _graphed(lambda: moe_decode.fused_moe_triton(*args, shared_w13=sw13, use_pdl=True))
    for seed in (1, 2, 3):
        ids, wts = random_routing(n, shape["e"], shape["k"], "cuda", seed)
        p["topk_ids"].copy_(ids)
        p["topk_weights"].copy_(wts)
        p["x"].copy_(torch.randn_like(p["x"], dtype=torch.float32).bfloat16())
        graph.replay()
        f32 = {key: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
               for key, v in p.items()}
        ref = fused_moe_reference(*_op_args(f32, "silu", 0)[:13], shared_w13=sw13.float())
        assert _rel(out, ref) < 1e-2, (seed, _rel(out, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_l2_prefetch_and_early_release_give_the_same_bits_at_the_48b_shape(n):
    """shared_l2_prefetch (kernel A: shared slot first, its gate/up rows asked of L2 before gdc_wait),
    down_l2_prefetch (B''s shared slot), early_release (A releases B' right after its wait) and down_early_release (B'
    releases the next kernel right after its wait) at the 48B shape, PDL on, rows and tiles designs of A, eager and
    replayed from a CUDA graph after a router-like kernel: outputs bit-identical with the options off, and within the
    reference's tolerance."""
    p, sw13 = _with_shared_w13(_cuda_problem(n, 600 + n, **_shape_48b()), 600 + n)
    f32 = {key: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v) for key, v in p.items()}
    ref = fused_moe_reference(*_op_args(f32, "silu", 0)[:13], shared_w13=sw13.float())
    args = _op_args(p, "silu", 0)[:13]
    for up in ("rows", "tiles"):
        off = moe_decode.fused_moe_triton(*args, shared_w13=sw13, use_pdl=True, designs=(up, "split"))
        for a, b, early, down in ((True, False, False, False), (False, True, False, False), (True, True, False, False),
                                  (False, False, True, False), (True, True, True, False), (False, False, False, True),
                                  (True, True, True, True)):
            on = moe_decode.fused_moe_triton(*args, shared_w13=sw13, use_pdl=True, designs=(up, "split"),
                                             shared_l2_prefetch=a, down_l2_prefetch=b, early_release=early,
                                             down_early_release=down)
            torch.cuda.synchronize()
            assert torch.equal(on, off), (up, a, b, early, down)
        assert _rel(off, ref) < 1e-2, (up, _rel(off, ref))
    # the op as the engine calls it (options as its last two arguments), replayed from a CUDA graph behind another
    # kernel, as a step replays it
    scratch = torch.empty(1 << 22, device="cuda")
    graphs = []
    for on, early, down in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        def step(on=on, early=early, down=down):
            scratch.mul_(0.5)
            out = FUSED(*_op_args(p, "silu", 1 << 30), None, None, 1e-5, True, sw13, None, on, on, None, False, early,
                        down)
            return out * 1.0  # a kernel after the op, which B' releases early with down_early_release
        graphs.append(_graphed(step))
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(graphs[0][1], g[1]) for g in graphs[1:])
    assert _rel(graphs[1][1], ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_flag_deps_at_the_48b_shape(n):
    """flag_deps (kernel A releases B' right after its wait; each B' program spins on its own K chunk's counter) at the
    48B shape as P6 emits the op (shared slot in A, L2 options on, PDL on): bit-identical to flag_deps off at today's
    launches and with K chunks / other A launches, within the reference's tolerance, counters zero after every launch;
    then 26 layers' worth of ops in one CUDA graph (counters shared, never memset), replayed on new routings and inputs:
    the same bits as the same graph without flag_deps, and the reference."""
    from k3compile.passes.kernels import arrivals
    shape = _shape_48b()
    p, sw13 = _with_shared_w13(_cuda_problem(n, 700 + n, **shape), 700 + n)
    args = _op_args(p, "silu", 0)[:13]
    opts = dict(shared_w13=sw13, use_pdl=True, shared_l2_prefetch=True, down_l2_prefetch=True)
    f32 = {key: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v) for key, v in p.items()}
    ref = fused_moe_reference(*_op_args(f32, "silu", 0)[:13], shared_w13=sw13.float())
    for split, up in [(None, None), (None, (64, 128, 4))] + [(s, None) for s in moe_launch.FLAG_SPLIT_CANDIDATES]:
        off = moe_decode.fused_moe_triton(*args, **opts, split=split, up_launch=up)
        for _ in range(3):
            on = moe_decode.fused_moe_triton(*args, **opts, split=split, up_launch=up, flag_deps=True)
            torch.cuda.synchronize()
            assert torch.equal(on, off), (split, up)
            assert not arrivals.current(on.device, moe_decode.FLAGS_OWNER).any(), (split, up)
        assert _rel(on, ref) < 1e-2, (split, up, _rel(on, ref))

    def layers(flags):  # one layer's op 26 times in a row, each reading the previous output (as the step chains them)
        y = p["x"]
        for _ in range(26):
            y = moe_decode.fused_moe_triton(y, *args[1:], **opts, flag_deps=flags) * 0.5 + p["x"]
        return y
    graphs = [_graphed(lambda flags=flags: layers(flags)) for flags in (False, True)]
    for seed in (1, 2):
        ids, wts = random_routing(n, shape["e"], shape["k"], "cuda", seed)
        p["topk_ids"].copy_(ids)
        p["topk_weights"].copy_(wts)
        p["x"].copy_(torch.randn_like(p["x"], dtype=torch.float32).bfloat16())
        for graph, _ in graphs:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphs[0][1], graphs[1][1]), seed
        assert not arrivals.current(p["x"].device, moe_decode.FLAGS_OWNER).any(), seed
        f32 = {key: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
               for key, v in p.items()}
        one = fused_moe_reference(*_op_args(f32, "silu", 0)[:13], shared_w13=sw13.float())
        assert _rel(moe_decode.fused_moe_triton(*args, **opts, flag_deps=True), one) < 1e-2, seed
