"""The dense GLU activation op (p17_dense_glu): the op on CPU is model_def's glu_act, the Triton kernel under the
interpreter and on CUDA at k3-mini-6b / Kimi-Linear-48B dense MLP shapes, argument errors, registration."""
import pytest
import torch

from k3compile.model_def.ops.moe_math import glu_act
from k3compile.passes.kernels import glu_act as kernel

from .interpreted import run_interpreted

GLU_ACT = torch.ops.k3.glu_act.default


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_on_cpu_is_the_model_activation(act, dtype):
    gen = torch.Generator().manual_seed(1)
    gu = (torch.randn(3, 70, generator=gen) * 6).to(dtype)
    gate, up = gu[:, :35], gu[:, 35:]
    assert torch.equal(GLU_ACT(gate, up, act, 4.0, 25.0), glu_act(gate, up, act, 4.0, 25.0))


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_glu_act.py")


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        GLU_ACT(torch.zeros(2, 4), torch.zeros(2, 4), "gelu", 4.0, 25.0)
    with pytest.raises(ValueError, match="gate and up must be"):
        GLU_ACT(torch.zeros(2, 4), torch.zeros(2, 5), "situ", 4.0, 25.0)
    with pytest.raises(ValueError, match="gate and up must be"):
        GLU_ACT(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16), "situ", 4.0, 25.0)


def test_op_passes_opcheck():
    gu = torch.randn(2, 16)
    torch.library.opcheck(GLU_ACT, (gu[:, :8], gu[:, 8:], "situ", 4.0, 25.0))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 64, 2048])  # decode batches and a prefill chunk
@pytest.mark.parametrize("act,inter", [("situ", 8192), ("silu", 9216)])  # k3-mini-6b / 48B dense MLP
def test_cuda_kernel_matches_reference_at_dense_mlp_shapes(tokens, act, inter):
    gen = torch.Generator().manual_seed(tokens)
    gu = (torch.randn(tokens, 2 * inter, generator=gen) * 6).bfloat16().cuda()  # the merged gate/up GEMM's output
    gate, up = gu[:, :inter], gu[:, inter:]
    got = GLU_ACT(gate, up, act, 4.0, 25.0)
    # against the fp32 activation rounded once: the kernel rounds once (situ) or as ATen does (silu)
    want = glu_act(gate.float(), up.float(), act, 4.0, 25.0)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert got.shape == (tokens, inter) and got.dtype == torch.bfloat16 and err <= 1e-2
    ref_err = ((glu_act(gate, up, act, 4.0, 25.0).float() - want).abs().max() / want.abs().max()).item()
    assert err <= ref_err + 4e-3  # no worse than the unfused bf16 ops, up to an ulp
