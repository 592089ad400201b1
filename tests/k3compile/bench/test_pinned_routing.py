"""Pinned routing for the accuracy gate (k3compile/bench/pinned_routing.py) and the gate's calibration probes
(gate_probes.py) on the tiny presets, bf16 and fp32.

The models get random weights with std hidden^-1/2, the gain the real shapes have at init_random's 0.02
(2304^-1/2 = 0.021): with 0.02 at hidden 64 every layer shrinks its input, so neither routing flips nor
bugs in one layer reach the logits, and the gate's regime (amplification over layers) does not exist."""
import pytest
import torch

from k3compile.bench.accuracy_gate import CALIBRATION_PROBE, GATE_TOLERANCE, calibrated_tolerance, run_gate
from k3compile.bench.gate_probes import injected_bug, probe_runners, reordered_gemms
from k3compile.bench.pinned_routing import PIN_BASE, PIN_GAP, pinned_experts, pinned_routing, routers
from k3compile.capture import step_args
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.config import get_preset
from k3compile.model_def.init import init_random
from k3compile.model_def.loader import build_model
from k3compile.model_def.ops.moe_math import route
from k3compile.passes.kernels.routing import route_reference

PRESETS = ["kimi-linear-tiny", "k3-tiny"]
DTYPES = [torch.bfloat16, torch.float32]
B, STEPS, CONTEXT, PAGE = 4, 2, 8, 16


def gain_matched(name, dtype, cfg=None):
    cfg = cfg or get_preset(name)
    model = build_model(cfg, dtype, "cpu")
    init_random(model, 0, std=cfg.hidden_size ** -0.5)
    return model


class Decode:
    """A decode setup like the ladder's: random pools, restore(), batch_at(), the eager runner."""

    def __init__(self, model):
        self.cache = CacheTensors.allocate(model.cache_spec(), B + 1, B + 1, PAGE, "cpu")
        gen = torch.Generator().manual_seed(0)
        self.cache.kv.normal_(generator=gen)
        self.cache.ssm.normal_(0.0, 0.05, generator=gen)
        self.cache.conv.normal_(0.0, 0.5, generator=gen)
        self.pools = (self.cache.ssm, self.cache.conv, self.cache.kv)
        self.saved = [t.clone() for t in self.pools]
        self.first = torch.randint(0, 256, (B,), generator=gen).tolist()
        self.eager = lambda fb: model.step_tensors("decode", *step_args(fb, self.cache))

    def restore(self):
        for t, s in zip(self.pools, self.saved):
            t.copy_(s)

    @staticmethod
    def batch_at(ids, pos):
        return ForwardBatch.build("decode", [[t] for t in ids], [pos] * len(ids), [[1 + r] for r in range(len(ids))],
                                  list(range(1, len(ids) + 1)), PAGE, device="cpu")

    def gate(self, runners, order, tolerance, probes=None, calibrate=False):
        return run_gate({"eager": self.eager, **runners}, order, "eager", self.first, CONTEXT - STEPS, STEPS,
                        self.batch_at, self.restore, tolerance, probes, calibrate)


def record_routing(model):
    """Forward hooks on every router: per call, (router input x, weights, ids)."""
    seen = {i: [] for i in range(len(routers(model)))}
    handles = [r.register_forward_hook(lambda mod, inp, out, i=i: seen[i].append((inp[0], *out)))
               for i, r in enumerate(routers(model))]
    return seen, handles


def bits(t):
    return t.detach().contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", PRESETS)
def test_pinned_choices_ignore_rounding_and_weights_stay_unbiased(name, dtype):
    """Two prefills whose embeddings differ by one rounding step of the dtype: pinned, every router picks the
    same experts, in the same order, for every token; the weights stay the unbiased scores of those experts."""
    model = gain_matched(name, dtype)
    ids = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    emb = model.model.embed_tokens
    nudge = torch.Generator().manual_seed(2)

    def one_ulp(mod, inp, out):  # each value moved by about one unit in the last place of the dtype
        eps = torch.finfo(out.dtype).eps
        sign = torch.randint(0, 2, out.shape, generator=nudge).to(out.dtype) * 2 - 1
        return (out.float() * (1 + sign.float() * eps)).to(out.dtype)

    runs = []
    with pinned_routing(model) as pins:
        for perturbed in (False, True):
            seen, handles = record_routing(model)
            hook = emb.register_forward_hook(one_ulp) if perturbed else None
            model(ids)
            for h in handles + ([hook] if hook else []):
                h.remove()
            runs.append(seen)
    assert len(pins) == len(routers(model)) > 0
    x_clean, x_nudged = runs[0][0][0][0], runs[1][0][0][0]
    assert not torch.equal(x_clean, x_nudged)  # the routers did see different inputs
    for i, router in enumerate(routers(model)):
        for run in runs:
            (x, weights, chosen), = run[i]
            assert chosen.tolist() == [pins[i]] * chosen.shape[0], (name, i)
            # selection-only bias: weights = the unbiased sigmoid scores of the pinned experts, renormalized
            scores = torch.nn.functional.linear(x.float(), router.weight.float()).sigmoid().gather(1, chosen)
            if router.renorm:
                scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
            torch.testing.assert_close(weights, scores * router.scaling, rtol=1e-6, atol=1e-7)
            assert weights.std(0).max() > 0  # input-dependent: tokens weigh the same experts differently
    assert len({tuple(p) for p in pins.values()}) > 1  # layers pin different sets


def test_group_limited_routing_is_pinned_too():
    """num_expert_group > 1: the pinned experts lie in topk_group groups that the group limit keeps, for the
    reference route, P4's fused_route reference, whatever the logits."""
    import dataclasses

    from k3compile.model_def.layers.moe import Router

    cfg = dataclasses.replace(get_preset("kimi-linear-tiny"), num_experts=32, num_experts_per_token=6,
                              num_expert_group=8, topk_group=3)
    router = Router(cfg.hidden_size, cfg)
    gen = torch.Generator().manual_seed(0)
    ids = pinned_experts(32, 6, 8, 3, gen)
    assert len(set(ids)) == 6 and len({e // 4 for e in ids}) <= 3
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0.0, 3.0, generator=gen)  # a large trained-like bias
    model = torch.nn.Sequential(router)
    with pinned_routing(model) as pins:
        bias = router.e_score_correction_bias.clone()
        assert bias.min() == 0 and bias.max() == PIN_BASE + PIN_GAP * 5
        logits = torch.randn(64, 32, generator=gen) * 20  # saturated sigmoids: scores at 0 and 1
        for fn in (route, route_reference):
            w, chosen = fn(logits, bias, 6, True, 2.5, 8, 3)
            assert chosen.tolist() == [pins[0]] * 64, fn
            torch.testing.assert_close(w.sum(-1), torch.full((64,), 2.5))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", PRESETS)
def test_pinned_gate_passes_rounding_and_fails_bugs(name, dtype):
    """Pinned and calibrated: a rounding-only change other than the calibration probe (every GEMM split at K/3,
    not K/2) is within tolerance; one wrong MoE layer (shared expert dropped, experts shifted by one; in fp32
    also a x1.01 output) is over it. The weights come back bit-exactly, in the same storage."""
    model = gain_matched(name, dtype)
    d = Decode(model)
    before = {k: (v.data_ptr(), bits(v)) for k, v in model.state_dict().items()}

    def split_third(fb):
        with reordered_gemms(split=1 / 3):
            return d.eager(fb)
    bugs = ("drop_shared", "wrong_expert") + (("scale",) if dtype == torch.float32 else ())
    with torch.no_grad(), pinned_routing(model):
        res = d.gate({"rounding-only": split_third}, ["rounding-only"], GATE_TOLERANCE[dtype],
                     probe_runners(model, d.eager, bugs), calibrate=True)
    tol = res["eager"]["tolerance"]
    assert tol == calibrated_tolerance(GATE_TOLERANCE[dtype], res[CALIBRATION_PROBE]["rel_err"])
    assert res["rounding-only"]["ok"] and res["rounding-only"]["rel_err"] > 0, res["rounding-only"]
    for bug in bugs:
        assert not res[f"probe:bug-{bug}"]["ok"], (bug, res[f"probe:bug-{bug}"]["rel_err"], tol)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, (ptr, b) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(bits(after[k]), b), k


def test_restore_is_exact_after_an_error():
    model = gain_matched("k3-tiny", torch.bfloat16)
    saved = [bits(r.e_score_correction_bias) for r in routers(model)]
    with pytest.raises(RuntimeError, match="mid-gate"), pinned_routing(model):
        assert not torch.equal(bits(routers(model)[0].e_score_correction_bias), saved[0])
        raise RuntimeError("mid-gate")
    assert all(torch.equal(bits(r.e_score_correction_bias), s) for r, s in zip(routers(model), saved))


def test_probes_reject_bad_requests():
    model = gain_matched("kimi-linear-tiny", torch.float32)
    with pytest.raises(ValueError, match="unknown injected bug"), injected_bug(model, "typo"):
        pass
    with pytest.raises(ValueError, match="split must be in"), reordered_gemms(1.0):
        pass
    with pytest.raises(ValueError, match="calibrated gate needs"):
        Decode(model).gate({}, [], 1e-4, None, calibrate=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("experts,top_k,groups,topk_group", [(256, 8, 1, 1), (896, 16, 1, 1), (256, 8, 8, 4)])
def test_fused_route_kernel_follows_the_pin(experts, top_k, groups, topk_group):
    """P4's Triton routing kernel (what the rungs run on the H200) picks the pinned experts, in pin order, for
    every token of a batch, at the 48B (256 / top-8) and K3 (896 / top-16) router sizes."""
    import dataclasses

    from k3compile.model_def.layers.moe import Router
    from k3compile.passes.kernels.routing import route_triton

    cfg = dataclasses.replace(get_preset("kimi-linear-tiny"), num_experts=experts, num_experts_per_token=top_k,
                              num_expert_group=groups, topk_group=topk_group)
    model = torch.nn.Sequential(Router(cfg.hidden_size, cfg)).cuda()
    with pinned_routing(model) as pins:
        bias = model[0].e_score_correction_bias
        logits = torch.randn(64, experts, device="cuda") * 8
        w, chosen = route_triton(logits, bias, top_k, True, 2.446, groups, topk_group)
        assert chosen.tolist() == [pins[0]] * 64
        ref_w, _ = route(logits, bias, top_k, True, 2.446, groups, topk_group)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
