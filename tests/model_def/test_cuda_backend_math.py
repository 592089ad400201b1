"""The math behind the CUDA overrides, checked on CPU against the reference ops' math."""
import torch

from k3compile.model_def.ops import attention_math


def test_sdpa_prefill_equals_expanded_reference():
    g = torch.Generator().manual_seed(0)
    H, nope, rope, v, r = 3, 16, 8, 12, 20
    w = torch.randn(H * (nope + v), r, generator=g) * 0.2
    for T, prefix in [(1, 0), (5, 0), (4, 9), (1, 30)]:
        q = torch.randn(T, H, nope + rope, generator=g)
        rows = torch.randn(prefix + T, r + rope, generator=g)
        ref = attention_math.mla_expanded(q, rows, w, r, nope, 0.3, prefix)
        got = attention_math.mla_expanded_sdpa_batch(q[None], rows[None], w, r, nope, 0.3, torch.tensor([prefix]))[0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_sdpa_prefill_never_asks_for_cudnn():
    # cuDNN builds an execution graph per new shape (~12 ms of host time a call on the H200): prefill shapes change
    # with every prompt, so the MLA prefill must not reach it (attention_math.MLA_PREFILL_SDPA_BACKENDS says why)
    from torch.nn.attention import SDPBackend

    assert SDPBackend.CUDNN_ATTENTION not in attention_math.MLA_PREFILL_SDPA_BACKENDS
    assert SDPBackend.MATH in attention_math.MLA_PREFILL_SDPA_BACKENDS   # every device has a backend left



def test_grouped_gemm_experts_equal_loop_reference():
    from k3compile.model_def.ops import moe_math
    if not hasattr(torch, "_grouped_mm"):
        import pytest
        pytest.skip("torch._grouped_mm not available")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(7)])  # distinct experts per token
    w = torch.rand(7, 2, generator=g)
    w13, w2 = torch.randn(6, 32, 16, generator=g) * 0.2, torch.randn(6, 16, 16, generator=g) * 0.2
    for act in ("silu", "situ"):
        ref = moe_math.moe_experts_loop(x, ids, w, w13, w2, act, 4.0, 25.0)
        torch.testing.assert_close(moe_math.moe_experts_grouped(x, ids, w, w13, w2, act, 4.0, 25.0), ref,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(moe_math.moe_experts_gather(x, ids, w, w13, w2, act, 4.0, 25.0), ref,
                                   atol=1e-5, rtol=1e-5)
