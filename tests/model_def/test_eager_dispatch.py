"""model_def's `k3.NAME` calls: straight to the op's code in plain eager mode, through torch.ops.k3 whenever
something could tell the difference (tracing, modes, the profiler, autograd, fake tensors)."""
import traceback

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import k3compile
from k3compile.model_def.ops import eager_dispatch, library  # noqa: F401  (library registers the ops)
from k3compile.model_def.ops.eager_dispatch import k3
from tests.model_def.helpers import Sessions

B, H, K, V, LAYERS = 2, 2, 4, 3, 2


def decode_inputs(seed: int = 0, K: int = K, V: int = V):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, K, generator=g), torch.randn(B, H, K, generator=g)
    v, g_ = torch.randn(B, H, V, generator=g), -torch.rand(B, H, K, generator=g)
    beta = torch.rand(B, H, generator=g)
    pool = torch.randn(3, LAYERS, H, K, V, generator=g)
    return q, k, v, g_, beta, pool, 1, torch.tensor([2, 0])


@pytest.fixture
def through(monkeypatch):
    """calls[i] is True where the i-th kda_decode call ran inside the torch.library dispatcher."""
    from k3compile.model_def.ops import kda_math
    calls = []
    step = kda_math.kda_decode_step

    def spy(*args):  # the op's code calls it on either path
        calls.append(any("torch/_library" in f.f_code.co_filename for f, _ in traceback.walk_stack(None)))
        return step(*args)
    monkeypatch.setattr(kda_math, "kda_decode_step", spy)
    return calls


def test_plain_eager_call_skips_the_dispatcher_with_the_same_result(through):
    args = decode_inputs()
    pool_direct, pool_op = args[5].clone(), args[5].clone()
    with torch.no_grad():
        direct = k3.kda_decode(*args[:5], pool_direct, *args[6:])
        ref = torch.ops.k3.kda_decode(*args[:5], pool_op, *args[6:])
    assert through == [False, True]
    assert torch.equal(direct, ref) and torch.equal(pool_direct, pool_op)  # the same function on the same inputs


def test_grad_tracing_modes_and_profiler_go_through_the_dispatcher(through):
    q, *rest = decode_inputs()
    k3.kda_decode(q.requires_grad_(), *rest)  # autograd would record the op
    with torch.profiler.profile() as prof:
        k3.kda_decode(*decode_inputs())
    assert "k3::kda_decode" in {e.name for e in prof.events()}  # the trace keeps the op's own range

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    args = decode_inputs()
    with Seen() as seen:
        k3.kda_decode(*args)
    assert seen.ops == ["k3.kda_decode.default"]  # a dispatch mode sees the op, not its insides
    assert through == [True, True, True]


def test_make_fx_and_compile_see_one_op_node():
    args = decode_inputs()
    gm = make_fx(lambda *a: k3.kda_decode(*a), tracing_mode="symbolic")(*args)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.k3.kda_decode.default) == 1
    assert not [t for t in targets if "aten" in str(t) and "sym_size" not in str(t)]  # no inlined insides

    fresh, graphs = eager_dispatch._K3Ops(), []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward
    for first_lookup in ("under Dynamo", "eager"):  # Dynamo traces __getattr__, then the cached caller
        torch._dynamo.reset()  # the lambda's code object is the same both times: trace it again
        with torch.no_grad():
            if first_lookup == "eager":
                fresh.kda_decode(*args[:5], args[5].clone(), *args[6:])
            compiled = torch.compile(lambda *a: fresh.kda_decode(*a), backend=backend, fullgraph=True)
            pool_c, pool_e = args[5].clone(), args[5].clone()
            out = compiled(*args[:5], pool_c, *args[6:])
            ref = torch.ops.k3.kda_decode(*args[:5], pool_e, *args[6:])
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pool_c, pool_e, atol=1e-6, rtol=1e-6)
        assert graphs.pop() == ["k3.kda_decode"]  # Dynamo's graph holds the op, not its insides


def test_fake_tensors_take_the_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in decode_inputs()]
        out = k3.kda_decode(*args)
    assert type(out).__name__ == "FakeTensor" and out.shape == (B, H, V)


def test_mixed_devices_and_subclasses_are_left_to_the_dispatcher():
    t, weight = torch.ones(2), torch.nn.Parameter(torch.ones(2))

    class Sub(torch.Tensor):
        pass
    with torch.no_grad():
        assert eager_dispatch.direct_device((t, 3, weight)) == "cpu"
        assert eager_dispatch.direct_device((t, torch.empty(2, device="meta"))) is None
        assert eager_dispatch.direct_device((t, t.as_subclass(Sub))) is None
        assert eager_dispatch.direct_device((3, "x")) is None  # no tensor: no device to pick a kernel for
        assert eager_dispatch.direct_device(([t], t)) is None
    assert eager_dispatch.direct_device((t, weight)) is None  # grad mode and a leaf that wants a gradient
    assert eager_dispatch.direct_device((t, weight.detach())) == "cpu"


def test_unknown_op_is_refused_like_torch_ops():
    with pytest.raises(AttributeError):
        eager_dispatch._K3Ops().no_such_op


def test_k3_tiny_steps_are_identical_either_way(monkeypatch):
    """A prefill and decode steps of k3-tiny (every k3 op of the single-process model) with and without the
    dispatcher: the same logits and pools, bit for bit (the same functions run on the same inputs)."""
    model = k3compile.load_model("k3-tiny", seed=3)

    def run():
        s = Sessions(model, 2, 24)
        outs = [s.step("prefill", [0, 1], [[5, 7, 9, 11, 13], [2, 4, 6]], logits="all")]
        outs += [s.step("decode", [0, 1], [[t], [t + 1]]) for t in (17, 19, 23)]
        return outs, [p.clone() for p in (s.cache.ssm, s.cache.conv, s.cache.kv)]

    direct = run()
    monkeypatch.setattr(eager_dispatch, "direct_device", lambda args: None)
    dispatched = run()
    for a, b in zip(direct[0] + direct[1], dispatched[0] + dispatched[1]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_call_goes_direct_to_the_registered_cuda_kernel():
    """On CUDA the direct call runs what the dispatcher runs there (fla's kernel when it registered, else the
    reference): the same outputs and state updates as torch.ops.k3."""
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in decode_inputs(1, K=32, V=32)]  # kernel-sized heads
    assert eager_dispatch.direct_device(args) == "cuda"
    pool_direct, pool_op = args[5].clone(), args[5].clone()
    with torch.no_grad():
        direct = k3.kda_decode(*args[:5], pool_direct, *args[6:])
        ref = torch.ops.k3.kda_decode(*args[:5], pool_op, *args[6:])
    torch.testing.assert_close(direct, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool_direct, pool_op, atol=1e-6, rtol=1e-6)
