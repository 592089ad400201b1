"""The differentiable 'train' step mode and target feature capture (model.py FEATURES)."""
import pytest
import torch

import k3compile
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.layers.common import StepInputs
from k3compile.model_def.ops import moe_math
from tests.model_def.helpers import Sessions

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def model(request):
    return k3compile.load_model(request.param, seed=3)


def ids(b, t, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_train_forward_equals_forward(model):
    x = ids(3, 37)  # 37: KDA chunks of the train mode do not divide it
    torch.testing.assert_close(model.train_forward(x), model(x), **TOL)


def test_train_mode_ragged_sequences_match_one_by_one(model):
    x = ids(1, 50)[0]
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    h = model.model(x, StepInputs("train", cu))
    alone = [model.model(x[a:b], StepInputs("train", torch.tensor([0, b - a], dtype=torch.int32))) for a, b in
             ((0, 20), (20, 50))]
    torch.testing.assert_close(h, torch.cat(alone), **TOL)


def test_every_parameter_gets_a_gradient(model):
    m = k3compile.load_model(model.config.name, seed=3).requires_grad_(True)
    x = ids(2, 24)
    logits = m.train_forward(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    # layer 0's attention-side AttnRes read mixes a single source (the embedding): softmax = 1, no gradient
    exempt = {"model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"}
    dead = [n for n, p in m.named_parameters() if n not in exempt and (p.grad is None or not p.grad.abs().sum())]
    assert not dead


def test_moe_op_gradient_equals_reference_gradient():
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(10, 8, generator=g), torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    ids_ = torch.randint(0, 4, (10, 2), generator=g)
    w = torch.rand(10, 2, generator=g)
    grads = []
    for fn in (torch.ops.k3.moe_experts, moe_math.moe_experts_loop):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, w13, w2)]
        out = fn(leaves[0], ids_, leaves[1], leaves[2], leaves[3], "situ", 4.0, 25.0)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_step_features_equal_train_forward_features(model):
    layers = (0, 2, model.config.num_hidden_layers - 1)
    x = ids(1, 30)
    _, want = model.train_forward(x, layers)
    s = Sessions(model, 1, 32)
    # prefill 20 then decode 1: features of every packed token, in the same order
    got = []
    for chunk in (x[0, :20].tolist(), x[0, 20:21].tolist()):
        batch = ForwardBatch.build("prefill" if len(chunk) > 1 else "decode", [chunk], [s.lens[0]], [s.row(0)], [1],
                                   s.page_size)
        logits, f = model.step(batch, s.cache, feature_layers=layers)
        s.lens[0] += len(chunk)
        got.append(f)
    torch.testing.assert_close(torch.cat(got), want[0, :21], **TOL)


def test_feature_definition(model):
    """The last layer's feature, through the final norm and LM head, is the logits; under AttnRes the
    feature of layer l is what layer l + 1's attention side reads (its input_layernorm's input)."""
    n = model.config.num_hidden_layers
    x = ids(1, 12)
    logits, f = model.train_forward(x, tuple(range(n)))
    d = model.config.hidden_size
    torch.testing.assert_close(model.lm_head(model.model.norm(f[..., (n - 1) * d:])), logits, **TOL)
    seen = {}
    hooks = [model.model.layers[i].input_layernorm.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0])) for i in range(1, n)]
    try:
        model.train_forward(x)
    finally:
        for h in hooks:
            h.remove()
    for i in range(1, n):
        torch.testing.assert_close(f[0, :, (i - 1) * d: i * d], seen[i], **TOL)


def test_feature_layers_out_of_range(model):
    with pytest.raises(ValueError, match="out of range"):
        model.train_forward(ids(1, 4), (model.config.num_hidden_layers,))


@pytest.mark.gpu
def test_train_forward_and_gradients_on_cuda_match_cpu():
    cpu = k3compile.load_model("k3-tiny", seed=3).requires_grad_(True)
    gpu = k3compile.load_model("k3-tiny", seed=3)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda().requires_grad_(True)
    x = ids(2, 40)
    losses = []
    for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
        logits = m.train_forward(x[:, :-1].to(dev))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten().to(dev))
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1].cpu(), losses[0], atol=1e-4, rtol=1e-4)
    for (n, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-4, rtol=1e-3, msg=n)
