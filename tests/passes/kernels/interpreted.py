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


# Triton 3.9's InterpretedFunction.__call__ (whitespace collapsed), which _skip_repatching_in_nested_calls replaces
_HELPER_CALL_SOURCE = ("def __call__(self, *args, **kwargs): # This is a device function call _patch_lang(self.fn) "
                       "fn = self.rewrite() try: return fn(*args, **kwargs) except Exception as e: "
                       "raise InterpreterError(repr(e)) from e")


def _skip_repatching_in_nested_calls() -> None:
    """Triton's interpreter patches triton.language once per kernel launch (GridExecutor) and then AGAIN on every
    call of a @triton.jit function inside the kernel (InterpretedFunction.__call__: tl.sum, tl.sigmoid, our
    helpers), inspect.getmembers over tl / tl.core, tl.math and tl.tensor each time, and never undoes that call's
    patches. Re-patching a module already patched in this launch changes nothing (its builtins are wrappers by
    then and are skipped; the other attributes get equal wrappers again) and cost 25-45% of our scripts' time
    (user CPU without -> with this: interpret_moe_down_split.py 59.1 -> 31.4 s, interpret_kda_decode.py 31 -> 22 s).
    So a call inside a launch patches only when its globals see a triton.language module this launch has not
    patched yet. The kernels' arithmetic, masks and overflow
    checks are Triton's own, unchanged. Installed only on the Triton code it was written against."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_k3_nested_calls_patched", False):
        return
    executor_call, helper_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    if ("patch_scope = _patch_lang(self.fn)" not in inspect.getsource(executor_call)
            or " ".join(inspect.getsource(helper_call).split()) != _HELPER_CALL_SOURCE):
        return  # another Triton: leave its interpreter as it is

    launches = []  # per running launch: the triton.language modules patched so far in it

    def patched_langs(fn) -> set:  # what _patch_lang(fn) patches now (rewriting a function adds to its globals)
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def launch(self, *args, **kwargs):
        launches.append(patched_langs(self.fn))
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def helper(self, *args, **kwargs):
        langs = patched_langs(self.fn)
        if not (launches and langs <= launches[-1]):
            interpreter._patch_lang(self.fn)
            if launches:  # its patches stay at least until this launch ends (Triton never restores them)
                launches[-1] |= langs
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = helper
    interpreter._k3_nested_calls_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":  # a script run by run_interpreted (never the pytest process)
    _skip_repatching_in_nested_calls()
