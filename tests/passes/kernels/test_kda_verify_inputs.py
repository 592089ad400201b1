"""`k3::kda_verify_inputs` (pass P16's op): the Triton kernel under the interpreter against the CPU reference,
and the op's argument errors."""
import pytest
import torch

from k3compile.passes.kernels import kda_verify_inputs  # noqa: F401  (torch.ops.k3.kda_verify_inputs)

from .interpreted import run_interpreted


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_kda_verify_inputs.py")


def test_bad_shapes_name_the_problem():
    c, h = 32, 2
    win = [torch.zeros(2, 1, 4, h, 16), torch.zeros(2, 1, 4, h, 16), torch.zeros(2, 1, 4, h, 16), torch.zeros(2, 1, 4, h)]
    conv = torch.zeros(3, 1, 3 * c, 3)
    x = torch.zeros(6, c)
    args = dict(k_conv_weight=torch.zeros(c, 4), v_conv_weight=torch.zeros(c, 4), dt_bias=torch.zeros(c),
                a_log=torch.zeros(h), conv_pool=conv, layer=0, lower_bound=-5.0)
    op = torch.ops.k3.kda_verify_inputs
    with pytest.raises(ValueError, match="do not split into 4 requests"):
        op(x, x, f=x, beta_logits=torch.zeros(6, h), slots=torch.zeros(4, dtype=torch.long), win_k=win[0],
           win_v=win[1], win_g=win[2], win_beta=win[3], **args)
    with pytest.raises(ValueError, match="no room for 2 requests x 3 positions"):
        op(x, x, f=x, beta_logits=torch.zeros(6, h), slots=torch.zeros(2, dtype=torch.long), win_k=win[0][:, :, :2],
           win_v=win[1], win_g=win[2], win_beta=win[3], **args)
    with pytest.raises(ValueError, match="beta_logits"):
        op(x, x, f=x, beta_logits=torch.zeros(6, 3), slots=torch.zeros(2, dtype=torch.long), win_k=win[0],
           win_v=win[1], win_g=win[2], win_beta=win[3], **args)
