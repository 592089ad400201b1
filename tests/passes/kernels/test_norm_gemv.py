"""P8's fused norm + GEMV Triton kernel under the Triton interpreter on CPU against the references (the pass and
the op's CUDA tests: tests/passes/test_p08_small_m_norm_gemv.py)."""

from .interpreted import run_interpreted


def test_triton_kernel_under_interpreter_matches_references():
    run_interpreted("interpret_norm_gemv.py")
