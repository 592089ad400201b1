"""Running Triton kernels under TRITON_INTERPRET=1 from the test suite.

The flag is read when a kernel is decorated, i.e. when its module is first imported, and a pytest
process may already hold compiled (non-interpreted) copies; so each kernel family has a script
`interpret_<family>.py` that the test runs in a subprocess with the flag set.
"""
import os
import subprocess
import sys
from pathlib import Path

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # the scripts' relative-error bounds per dtype


def rel_err(a, b) -> float:
    """max|a - b| / max|b|, in fp32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def run_interpreted(script: str, timeout: int = 300) -> None:
    """Run tests/passes/kernels/<script> with TRITON_INTERPRET=1; fail with its output if any case failed."""
    path = Path(__file__).with_name(script)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cases match" in done.stdout


def report(failures: list[str], cases: int) -> int:
    """A script's summary: one FAIL line per failing case, the count, and its exit status."""
    for line in failures:
        print("FAIL", line)
    print(f"{cases - len(failures)}/{cases} cases match")
    return 1 if failures else 0
