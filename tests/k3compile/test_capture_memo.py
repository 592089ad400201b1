"""The test suite's shared captures (tests/k3compile/capture_memo.py): a capture is reused only for a model that
would give the same graph, and the reused graph reads the calling model's own weights."""
import torch

import k3compile
from k3compile import capture as capture_module
from k3compile.passes.verify import randomized_inputs, rel_err, run_graph, step_inputs
from tests.passes.helpers import eager_step

from .capture_memo import MemoCapture, model_key

MODEL = "kimi-linear-tiny"  # the cheaper tiny model to capture (~3 CPU s)


def _real_capture():
    installed = capture_module.capture_step  # tests/conftest.py installed the suite's memo over it
    return getattr(installed, "real", installed)


def test_the_key_follows_what_the_graph_depends_on():
    a, b = k3compile.load_model(MODEL, seed=0), k3compile.load_model(MODEL, seed=0)
    key = model_key(a, "decode", 4)
    assert key is not None and model_key(b, "decode", 4) == key  # another load of the same weights
    assert model_key(a, "prefill", 4) != key and model_key(a, "decode", 16) != key
    assert model_key(k3compile.load_model(MODEL, seed=1), "decode", 4) != key  # other weights
    assert model_key(k3compile.load_model(MODEL, dtype=torch.bfloat16), "decode", 4) != key
    assert model_key(k3compile.load_model("k3-tiny"), "decode", 4) != key
    router = next(m for m in b.modules() if type(m).__name__ == "Router")
    router.top_k += 1  # a module attribute the traced code reads
    assert model_key(b, "decode", 4) != key
    router.top_k -= 1
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1  # one weight element
    assert model_key(b, "decode", 4) != key
    hook = b.lm_head.register_forward_hook(lambda mod, args, out: out)
    assert model_key(k3compile.load_model(MODEL, seed=0), "decode", 4) == key
    c = k3compile.load_model(MODEL, seed=0)
    c.lm_head.register_forward_hook(lambda mod, args, out: out)
    assert model_key(c, "decode", 4) != key  # a hook changes what is traced
    hook.remove()
    c.scratch = object()  # an attribute with no stable repr: no key, so no sharing
    assert model_key(c, "decode", 4) is None


def test_captures_are_shared_only_while_enabled_and_per_key():
    traced = []

    def stub(model, mode, page_size):  # stands in for the trace: counts calls
        traced.append(mode)
        return torch.fx.symbolic_trace(torch.nn.Identity())
    memo = MemoCapture(stub)
    a = k3compile.load_model(MODEL, seed=0)
    memo(a, "decode")
    memo(a, "decode")
    assert traced == ["decode", "decode"] and (memo.hits, memo.misses) == (0, 0)  # off: every call traces
    memo.enabled = True
    for model in (a, k3compile.load_model(MODEL, seed=0), k3compile.load_model(MODEL, seed=1)):
        memo(model, "decode")
    memo(a, "prefill")
    assert traced == ["decode"] * 3 + ["decode", "prefill"] and (memo.hits, memo.misses) == (1, 3)


def test_a_shared_capture_is_a_copy_bound_to_the_callers_weights():
    memo = MemoCapture(_real_capture())
    memo.enabled = True
    a, b = k3compile.load_model(MODEL, seed=0), k3compile.load_model(MODEL, seed=0)
    first, shared = memo(a, "decode"), memo(b, "decode")
    assert (memo.hits, memo.misses) == (1, 1)
    assert shared is not first and shared.code == first.code and shared.meta == first.meta
    tensors = [list(gm.parameters()) + list(gm.buffers()) for gm in (first, shared)]
    own = {t.data_ptr() for t in list(b.parameters()) + list(b.buffers())}
    assert len(tensors[1]) == len(tensors[0]) > 100 and all(t.data_ptr() in own for t in tensors[1])
    assert not any(t.data_ptr() in own for t in tensors[0])
    # written in place after the capture (as the ladder pins router biases): the shared graph reads b's weights
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(1.5)
    inputs = randomized_inputs(step_inputs(b, "decode"), 0)
    got, want = run_graph(shared, inputs), eager_step(b, "decode", inputs)
    assert rel_err(got[0][0], want[0][0]) <= 1e-5
    assert rel_err(run_graph(first, inputs)[0][0], want[0][0]) > 1e-2  # a's graph: a's unchanged weights
