"""Running Triton kernels under TRITON_INTERPRET=1 from the test suite.

The flag is read when a kernel is decorated, i.e. when its module is first imported, and a pytest
process may already hold compiled (non-interpreted) copies; so each kernel family has a script
`interpret_<family>.py` that the test runs in another process with the flag set: one interpret_host.py
process per pytest process runs them all, one after the other (each script's own process imported torch,
Triton and k3compile again).
"""
import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # the scripts' relative-error bounds per dtype


def rel_err(a, b) -> float:
    """max|a - b| / max|b|, in fp32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


class InterpretHost:
    """A lazily started interpret_host.py process (TRITON_INTERPRET=1) that runs scripts one after the other."""

    def __init__(self):
        self.proc, self.log = None, None

    def run(self, script: Path, timeout: float) -> dict:
        """{"rc", "stdout", "stderr"} of `python script` run in the host; AssertionError if it did not end within
        `timeout` s (the host is killed) or the host died (the next run starts another)."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("interpret_host.py"))],
                                         env=dict(os.environ, TRITON_INTERPRET="1"), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.proc.stdin.write(json.dumps({"script": str(script)}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else None
        if not line:
            tail = self.close(kill=line is None)
            raise AssertionError(f"{script.name}: " + (f"not done in {timeout} s" if line is None else "host died")
                                 + f"; the host's stderr:\n{tail}")
        return json.loads(line)

    def close(self, kill: bool = False) -> str:
        """End the host (EOF on its stdin, or SIGKILL); the last lines of its stderr."""
        proc, log, self.proc, self.log = self.proc, self.log, None, None
        if proc is None:
            return ""
        if kill:
            proc.kill()
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        log.seek(0)
        tail = log.read()[-4000:].decode(errors="replace")
        log.close()
        return tail


_HOST = InterpretHost()  # this pytest process's
atexit.register(_HOST.close)


def run_interpreted(script: str | Path, timeout: int = 300) -> None:
    """Run the script (a name in tests/passes/kernels/, or a path) with TRITON_INTERPRET=1 in this process's
    interpret_host.py; fail with its output if any case failed."""
    path = Path(__file__).with_name(script) if isinstance(script, str) else Path(script)
    done = _HOST.run(path, timeout)
    assert done["rc"] == 0, done["stdout"] + done["stderr"]
    assert "cases match" in done["stdout"]


def report(failures: list[str], cases: int) -> int:
    """A script's summary: one FAIL line per failing case, the count, and its exit status."""
    for line in failures:
        print("FAIL", line)
    print(f"{cases - len(failures)}/{cases} cases match")
    return 1 if failures else 0


def run_cases(cases) -> int:
    """Run (name, run) cases whose run() returns (rel err, tolerance); report() their failures."""
    failures, n = [], 0
    for name, run in cases:
        n += 1
        err, tol = run()
        if not err <= tol:
            failures.append(f"{name}: rel err {err:.3g} > {tol:g}")
    return report(failures, n)


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
