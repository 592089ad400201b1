"""Fused KDA decode (k3::fused_kda_decode): the reference vs the independent per-sequence math, the
Triton kernel (under the interpreter on CPU, natively on CUDA at real shapes), argument errors, and
the op's registration and traceability."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.model_def.config import get_preset
from k3compile.model_def.ops import kda_math
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT
from k3compile.passes.kernels.kda_decode import fused_kda_decode_reference, fused_kda_decode_triton

from .interpreted import run_interpreted
from .kda_decode_cases import make_case, rel_err

FUSED = torch.ops.k3.fused_kda_decode.default


def _per_sequence(case):
    """The same step from kda_math's single-sequence functions, one request at a time (out, conv, ssm)."""
    conv, ssm = case.conv_pool.clone(), case.ssm_pool.clone()
    c = case.f.shape[1]
    h = case.a_log.shape[0]
    kd = c // h
    outs = []
    for i, slot in enumerate(case.slots.tolist()):
        streams = []
        for s, (x, w) in enumerate(zip(case.x, case.conv_weights)):
            win = conv[slot, case.layer, s * c:(s + 1) * c]
            y, new = kda_math.short_conv(x[i:i + 1], w, win)
            conv[slot, case.layer, s * c:(s + 1) * c] = new
            streams.append(y.view(1, h, kd))
        g = kda_math.kda_gate(case.f[i:i + 1], case.a_log, case.dt_bias, kd, case.lower_bound)
        beta = torch.sigmoid(case.beta_logits[i:i + 1].float())
        o, s1 = kda_math.kda_recurrent(*streams, g, beta, ssm[slot, case.layer])
        ssm[slot, case.layer] = s1
        o = o.to(case.x[2].dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + case.norm_eps) * case.norm_weight.float()
        outs.append((o * torch.sigmoid(case.gate[i:i + 1].float())).to(case.x[2].dtype))
    return torch.cat(outs), conv, ssm


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_reference_matches_the_per_sequence_math(lower_bound):
    case = make_case(batch=4, heads=2, head_dim=16, lower_bound=lower_bound, slots=[3, 0, 5, 1], layer=1)
    args = case.args()
    out = fused_kda_decode_reference(*args)
    want_out, want_conv, want_ssm = _per_sequence(case)
    assert out.shape == (4, 2, 16) and out.dtype == torch.float32
    assert rel_err(out, want_out) < 1e-5
    assert torch.equal(args[12], want_conv)  # the windows move values, no arithmetic
    assert rel_err(args[13], want_ssm) < 1e-5
    untouched = case.untouched_slots()
    assert torch.equal(args[13][untouched], case.ssm_pool[untouched])
    assert not torch.equal(args[13][case.slots], case.ssm_pool[case.slots])  # updated in place


def test_low_rank_inputs_are_the_up_projections():
    case = make_case(batch=3, heads=2, head_dim=16, lower_bound=None, f_rank=8, g_rank=12, slots=[1, 0, 2])
    args = list(case.args())
    full = list(case.args())
    full[6] = case.f @ case.f_b_weight.t()
    full[10] = (case.gate @ case.g_b_weight.t()).view(3, 2, 16)
    full[18] = full[19] = None
    assert torch.equal(FUSED(*args), FUSED(*full))
    assert torch.equal(args[13], full[13]) and torch.equal(args[12], full[12])


def test_gate_variants_differ():
    kw = dict(batch=2, heads=2, head_dim=16, seed=4)
    kimi, k3 = make_case(lower_bound=None, **kw), make_case(lower_bound=-5.0, **kw)
    k3.a_log = kimi.a_log  # same inputs, only the gate form differs
    assert rel_err(fused_kda_decode_reference(*k3.args()), fused_kda_decode_reference(*kimi.args())) > 1e-3


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_kda_decode.py", timeout=900)  # 23 cases; slow on a loaded CPU


def test_op_passes_opcheck_on_cpu():
    for lb in (None, -5.0):
        case = make_case(batch=3, heads=2, head_dim=8, lower_bound=lb, slots=[2, 0, 1])
        torch.library.opcheck(FUSED, case.args() + (False,))
        a, b = case.args(), case.args()
        assert torch.equal(FUSED(*a), fused_kda_decode_reference(*b))
        assert torch.equal(a[12], b[12]) and torch.equal(a[13], b[13])


def test_op_takes_a_launch_layout_by_name():
    case = make_case(batch=2, heads=2, head_dim=16, lower_bound=None, slots=[1, 0])
    torch.library.opcheck(FUSED, case.args() + (False, True, "s8"))
    torch.library.opcheck(FUSED, case.args() + (True, True, "s8", True))  # early_release: the same op on CPU
    with pytest.raises(ValueError, match="unknown KDA decode launch layout 'wide'"):  # dropped in session 9
        FUSED(*case.args(), False, True, "wide")
    with pytest.raises(ValueError, match="unknown KDA decode launch layout 'fast'"):
        fused_kda_decode_triton(*case.args(), layout="fast")


def test_op_stays_one_node_under_make_fx():
    case = make_case(batch=3, heads=2, head_dim=8, lower_bound=-5.0)

    def fn(*args):
        return torch.ops.k3.fused_kda_decode(*args)

    gm = make_fx(fn, tracing_mode="symbolic")(*case.args())
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [FUSED]
    a, b = case.args(), case.args()
    torch.testing.assert_close(gm(*a), fused_kda_decode_reference(*b))


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(1, a[1][:, :-1]), "q/k/v inputs must be"),
    (lambda a: a.__setitem__(8, torch.zeros(3)), "do not split into 3 heads"),
    (lambda a: a.__setitem__(10, a[10][:, :1]), "gate must be \\[B, H, V\\]"),
    (lambda a: a.__setitem__(11, torch.ones(7)), "norm weight must be \\[V\\] = \\[16\\]"),
    (lambda a: a.__setitem__(7, torch.zeros(5)), "dt_bias must be"),
    (lambda a: a.__setitem__(13, a[13].double()), "ssm pool must be fp32"),
    (lambda a: a.__setitem__(12, a[12][..., :2]), "conv pool must be"),
    (lambda a: a.__setitem__(14, 7), "layer 7 out of range"),
    (lambda a: a.__setitem__(15, a[15].float()), "slots must be an integer"),
    (lambda a: a.__setitem__(18, torch.zeros(32, 5)), "low-rank forget input must be \\[B, R\\] = \\[2, 5\\]"),
    (lambda a: a.__setitem__(19, torch.zeros(31, 4)), "g_b weight must be \\[H\\*V, R\\]"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    args = list(make_case(batch=2, heads=2, head_dim=16, lower_bound=-5.0).args())
    change(args)
    with pytest.raises(ValueError, match=message):
        fused_kda_decode_reference(*args)
    with pytest.raises(ValueError, match=message):
        FUSED(*args)


# ------------------------------------------------------------------------------------- CUDA

def _real_shape(preset: str):
    cfg = get_preset(preset)
    return cfg.kda_num_heads, cfg.kda_head_dim, cfg.gate_lower_bound


def _low_rank(preset: str, absorbed: bool) -> dict:
    """P5's default absorbs f_b_proj (rank = head dim) and, for Kimi Linear, g_b_proj."""
    cfg = get_preset(preset)
    if not absorbed:
        return {}
    return dict(f_rank=cfg.kda_head_dim, g_rank=0 if cfg.kda_full_rank_gate else cfg.kda_head_dim)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["kimi-linear-48b", "k3"])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("absorbed", [True, False])
def test_cuda_kernel_matches_reference_at_real_shapes(preset, batch, dtype, absorbed):
    heads, head_dim, lower_bound = _real_shape(preset)
    slots = torch.randperm(batch + 3, generator=torch.Generator().manual_seed(batch))[:batch].tolist()
    case = make_case(batch=batch, heads=heads, head_dim=head_dim, lower_bound=lower_bound, dtype=dtype, layer=1,
                     slots=slots, seed=batch, device="cuda", **_low_rank(preset, absorbed))
    want_args, got_args = case.args(), case.args()
    want = fused_kda_decode_reference(*want_args)
    got = FUSED(*got_args)  # the CUDA registration: the Triton kernel
    torch.cuda.synchronize()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == want.dtype and got.shape == want.shape
    for what, a, b in (("output", got, want), ("conv pool", got_args[12], want_args[12]),
                       ("ssm pool", got_args[13], want_args[13])):
        assert rel_err(a, b) <= tol, f"{what}: rel err {rel_err(a, b):.3g}"
    untouched = case.untouched_slots()
    assert torch.equal(got_args[13][untouched], case.ssm_pool[untouched])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_with_pdl_matches_reference():
    heads, head_dim, lower_bound = _real_shape("kimi-linear-48b")
    case = make_case(batch=8, heads=heads, head_dim=head_dim, lower_bound=lower_bound, dtype=torch.bfloat16,
                     slots=[9, 3, 0, 12, 5, 7, 1, 14], seed=3, device="cuda", **_low_rank("kimi-linear-48b", True))
    a, b = case.args(), case.args()
    got = fused_kda_decode_triton(*a, use_pdl=True)
    want = fused_kda_decode_reference(*b)
    assert rel_err(got, want) <= 3e-2 and rel_err(a[13], b[13]) <= 3e-2


def test_profiling_cost_counts_only_the_pool_rows_it_touches():
    from k3compile.engine.profiling import node_cost

    case = make_case(batch=3, heads=2, head_dim=16, lower_bound=None, f_rank=8, g_rank=8, slots=[1, 0, 2])
    args = case.args()
    out = fused_kda_decode_reference(*case.args())
    cost = node_cost(FUSED, args, {}, out, 0)
    dense = [*case.x, *case.conv_weights, case.f, case.dt_bias, case.a_log, case.beta_logits, case.gate,
             case.norm_weight, case.f_b_weight, case.g_b_weight, case.slots, out]
    state, window = 2 * 16 * 16 * 4, 3 * 32 * 3 * 4  # fp32 state [H, K, V]; fp32 window [3 * H * K, 3]
    assert cost == {"bytes": sum(t.numel() * t.element_size() for t in dense) + 3 * 2 * (state + window),
                    "flops": 6 * 3 * 32 * 16 + 2 * 2 * 3 * 32 * 8, "exact": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["kimi-linear-48b", "k3-mini-6b"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("v_split", [1, 2, 4, 8])
def test_cuda_kernel_v_split_matches_reference(preset, batch, v_split):
    """Every V split at real shapes, bf16, PDL on where available, low-rank GEMVs absorbed."""
    heads, head_dim, lower_bound = _real_shape(preset)
    slots = torch.randperm(batch + 5, generator=torch.Generator().manual_seed(7))[:batch].tolist()
    case = make_case(batch=batch, heads=heads, head_dim=head_dim, lower_bound=lower_bound, dtype=torch.bfloat16,
                     layer=1, slots=slots, seed=11, device="cuda", **_low_rank(preset, True))
    a, b = case.args(), case.args()
    got = fused_kda_decode_triton(*a, use_pdl=True, v_split=v_split)
    want = fused_kda_decode_reference(*b)
    for what, x, y in (("output", got, want), ("conv pool", a[12], b[12]), ("ssm pool", a[13], b[13])):
        assert rel_err(x, y) <= 3e-2, f"{what}: rel err {rel_err(x, y):.3g}"
    from k3compile.passes.kernels import arrivals, kda_decode
    if v_split > 1:
        assert not arrivals.current(got.device, kda_decode.ARRIVALS_OWNER).any()  # counters zero again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_of_the_split_kernel_match_eager_steps():
    """Three replays of a captured split-V launch = three eager steps (pools advance; counters re-zero), through
    the op with P5's launch layout option (batch 1 at the 48B shape: V split 4 under s8)."""
    layout = "s8"
    heads, head_dim, lower_bound = _real_shape("kimi-linear-48b")
    case = make_case(batch=1, heads=heads, head_dim=head_dim, lower_bound=lower_bound, dtype=torch.bfloat16,
                     slots=[2], seed=5, device="cuda", **_low_rank("kimi-linear-48b", True))
    a, b = case.args(), case.args()
    FUSED(*a, True, True, layout)  # eager warm-up (allocates the shared counters, compiles), as the executor does
    fused_kda_decode_reference(*b)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = FUSED(*a, True, True, layout)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        graph.replay()
        want = fused_kda_decode_reference(*b)
        torch.cuda.synchronize()
        assert rel_err(out, want) <= 3e-2 and rel_err(a[13], b[13]) <= 3e-2 and rel_err(a[12], b[12]) <= 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,early", [(1, False), (8, False), (1, True), (8, True)])
def test_pdl_chain_in_a_cuda_graph_matches_the_reference(batch, early):
    """48B shape, bf16: x -> P8's GEMV (in_proj, PDL) -> P5's kernel (PDL, prefetch before gdc_wait: pools and
    weights early, the GEMV's output only after the wait) -> P8's GEMV (o_proj, PDL), captured once and replayed
    for three steps with new x; each step's output and pools vs the reference ops (cuBLAS mm + the unfused
    KDA ops) on their own pool copies. A read of the GEMV's output before the wait, or of a pool row the step
    writes, would show as a mismatch. early: every kernel of the chain releases the next one right after its wait
    (P8's and P5's early_release), so each next kernel is resident for all of its predecessor's run."""
    from k3compile.passes.kernels.gemv import default_config, gemv_triton

    heads, head_dim, lower_bound = _real_shape("kimi-linear-48b")
    cfg = get_preset("kimi-linear-48b")
    c, d = heads * head_dim, cfg.hidden_size
    slots = torch.randperm(batch + 5, generator=torch.Generator().manual_seed(3))[:batch].tolist()
    case = make_case(batch=batch, heads=heads, head_dim=head_dim, lower_bound=lower_bound, dtype=torch.bfloat16,
                     layer=1, slots=slots, seed=13, device="cuda", **_low_rank("kimi-linear-48b", True))
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_in = 3 * c + 2 * head_dim + heads  # q, k, v, f_a, g_a, beta columns of the merged in-proj
    w_in = (torch.randn(n_in, d, device="cuda", generator=gen) / d ** 0.5).bfloat16()
    w_out = (torch.randn(d, c, device="cuda", generator=gen) / c ** 0.5).bfloat16()
    x = torch.empty(batch, d, device="cuda", dtype=torch.bfloat16)
    graph_pools, ref_pools = case.args()[12:14], case.args()[12:14]
    cfg_in, cfg_out = default_config(n_in, d), default_config(d, c)

    def kda_args(y, pools):
        xq, xk, xv = (y[:, i * c:(i + 1) * c] for i in range(3))
        f, g = y[:, 3 * c:3 * c + head_dim], y[:, 3 * c + head_dim:3 * c + 2 * head_dim]
        beta = y[:, 3 * c + 2 * head_dim:]
        return (xq, xk, xv, *case.conv_weights, f, case.dt_bias, case.a_log, beta, g, case.norm_weight, *pools,
                case.layer, case.slots, case.lower_bound, case.norm_eps, case.f_b_weight, case.g_b_weight)

    def step():
        y = gemv_triton(x, w_in, None, *cfg_in, use_pdl=True, early_release=early)
        o = FUSED(*kda_args(y, graph_pools), True, True, DEFAULT_LAYOUT, early)  # use_pdl, prefetch, launch, early
        return gemv_triton(o.flatten(1), w_out, None, *cfg_out, use_pdl=True, early_release=early)

    x.copy_(torch.randn(batch, d, device="cuda", generator=gen).bfloat16())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up step (compiles, allocates the shared counters), then capture
        step()
        fused_kda_decode_reference(*kda_args(torch.mm(x, w_in.t()), ref_pools))  # the same step on the reference
        side.synchronize()
        assert rel_err(graph_pools[1], ref_pools[1]) <= 3e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        x.copy_(torch.randn(batch, d, device="cuda", generator=gen).bfloat16())
        graph.replay()
        want = torch.mm(fused_kda_decode_reference(*kda_args(torch.mm(x, w_in.t()), ref_pools)).flatten(1),
                        w_out.t())
        torch.cuda.synchronize()
        for what, a, b in (("output", out, want), ("conv pool", graph_pools[0], ref_pools[0]),
                           ("ssm pool", graph_pools[1], ref_pools[1])):
            assert rel_err(a, b) <= 3e-2, f"{what}: rel err {rel_err(a, b):.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,v_split,block_v,num_warps", [
    (1, 4, 32, 2), (1, 2, 64, 8), (1, 8, 16, 4), (8, 1, 128, 16), (8, 1, 64, 8), (8, 2, 32, 4)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_cuda_kernel_launch_choices_match_reference(batch, v_split, block_v, num_warps, prefetch):
    """The launch choices tools/bench_kda8.py sweeps, at the 48B shape, bf16, PDL on, low-rank GEMVs absorbed."""
    heads, head_dim, lower_bound = _real_shape("kimi-linear-48b")
    slots = torch.randperm(batch + 5, generator=torch.Generator().manual_seed(9))[:batch].tolist()
    case = make_case(batch=batch, heads=heads, head_dim=head_dim, lower_bound=lower_bound, dtype=torch.bfloat16,
                     layer=1, slots=slots, seed=17, device="cuda", **_low_rank("kimi-linear-48b", True))
    a, b = case.args(), case.args()
    got = fused_kda_decode_triton(*a, use_pdl=True, v_split=v_split, block_v=block_v, num_warps=num_warps,
                                  prefetch=prefetch)
    want = fused_kda_decode_reference(*b)
    for what, x, y in (("output", got, want), ("conv pool", a[12], b[12]), ("ssm pool", a[13], b[13])):
        assert rel_err(x, y) <= 3e-2, f"{what}: rel err {rel_err(x, y):.3g}"
