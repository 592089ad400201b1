"""P9's collective op: the fused path (in-place all-reduce + P7's Triton kernel) under the Triton interpreter
over gloo (2 ranks) against the composite, and bad arguments."""
import pytest
import torch

from k3compile.passes.kernels import all_reduce_norm  # noqa: F401  (registers the ops)

from .interpreted import run_interpreted


def test_fused_path_under_interpreter_over_gloo_matches_composite():
    run_interpreted("interpret_all_reduce_norm.py")


@pytest.mark.parametrize("x,partial,message", [
    (torch.zeros(2, 8), torch.zeros(3, 8), "partial must match x"),
    (None, torch.zeros(8, 2).t(), "must be contiguous"),
])
def test_bad_arguments_raise_clear_errors(x, partial, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.k3.all_reduce_attn_res_norm([], x, partial, None, torch.ones(8), 1e-5, 1e-5, "world")
