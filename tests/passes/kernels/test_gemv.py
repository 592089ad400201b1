"""P8's GEMV Triton kernel (k3::gemv) under the Triton interpreter on CPU against the aten reference (the pass and
the op's CUDA tests: tests/passes/test_p08_small_m_gemm.py)."""

from .interpreted import run_interpreted


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_gemv.py", timeout=600)
