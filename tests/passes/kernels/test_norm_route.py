"""P7's fused norm + router Triton kernel (k3::attn_res_norm_route) under the Triton interpreter on CPU against the
references (the pass and the op's CUDA tests: tests/passes/test_p07_norm_route.py)."""

from .interpreted import run_interpreted


def test_triton_kernel_under_interpreter_matches_references():
    run_interpreted("interpret_norm_route.py")
