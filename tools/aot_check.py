"""Compile-only check of the project's Triton kernels for an H100/H200 (sm90) on a machine without a GPU.

Patches `JITFunction.run` so that every `kernel[grid](...)` made by the project's CPU-side launchers (called with
CPU tensors) compiles the kernel for sm90 with Triton's ahead-of-time compiler instead of launching it: the
signature comes from the actual arguments, the constexprs from the call. A kernel that the GPU box's Triton
would refuse (type errors, unsupported ops) fails here, before any device time is spent. Outputs are never
computed (the launchers' results are garbage): this checks compilation only.

    python tools/aot_check.py            # every case below; exit 1 if any kernel fails to compile
    python tools/aot_check.py gemv mla   # only the cases whose name contains one of the words
    python tools/aot_check.py --ptx DIR moe   # also write each compiled kernel's PTX to DIR (to grep it)
    python tools/aot_check.py --regs route    # also each kernel's registers a thread and spills (ptxas -v, sm_90a)
Run it under the Triton the GPU box has (e.g. a venv with triton==3.6.0) as well as the local one.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "launch_pdl")
compiled: list[str] = []
ptx_dir: str | None = None  # --ptx DIR: where each compiled kernel's PTX goes (case index, kernel name)
report_regs = False  # --regs: run ptxas -v on each kernel's PTX


def _sig(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if not -2 ** 31 <= value < 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {value!r}")


def _compile_only(self, *args, grid, warmup, **kwargs):
    names = self.arg_names
    params = {p.name: p for p in self.params}
    values = dict(zip(names, args))
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    values.update(kwargs)
    signature, constexprs = {}, {}
    for name in names:
        v = values.get(name, params[name].default)
        if params[name].is_constexpr or v is None:
            signature[name] = "constexpr"
            constexprs[name] = v
        else:
            signature[name] = _sig(v)
    options.pop("launch_pdl", None)  # a launch attribute, not a compile option
    # the specialization a launch gets: pointers 16-byte aligned, ints that are multiples of 16 marked so (without
    # it every masked bf16 load compiles to 2-byte loads, not the 16-byte ones the GPU runs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name] != "constexpr"
             and (isinstance(values.get(name), torch.Tensor)
                  or (type(values.get(name)) is int and values[name] % 16 == 0))}
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    compiled.append(self.fn.__name__)
    if report_regs:
        compiled[-1] += f" ({ptxas_usage(kernel.asm['ptx'])})"
    if ptx_dir is not None:
        with open(os.path.join(ptx_dir, f"{len(compiled):03d}_{self.fn.__name__}.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
    return None


def ptxas_usage(ptx: str) -> str:
    """'R registers, S bytes spilled' from the ptxas that Triton bundles. Its PTX ISA can be older than the PTX Triton
    writes (Triton 3.9: PTX 9.4, its ptxas 8.8): then the .version line is lowered to the one ptxas names and it runs
    again; the kernels use no newer instruction (one that did fails here, named)."""
    from triton.backends.nvidia import compiler as nv
    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
            text = out.stdout + out.stderr
            older = re.search(r"Unsupported \.version \S+; current version is '([0-9.]+)'", text)
            if not older:
                break
            ptx = re.sub(r"^\.version \S+", f".version {older[1]}", ptx, count=1, flags=re.M)
    regs, spill = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
    if not regs:
        return "ptxas: " + (text.strip().splitlines() or ["no output"])[0]
    return f"{regs[1]} registers, {spill[1] if spill else 0} bytes spilled"


def main() -> int:
    JITFunction.run = _compile_only
    sys.path.insert(0, "tools")
    from aot_cases import CASES  # the launcher calls, one per kernel path
    global ptx_dir, report_regs
    words = sys.argv[1:]
    if "--regs" in words:
        report_regs = True
        words.remove("--regs")
    if words[:1] == ["--ptx"]:
        if len(words) < 2:
            sys.exit("aot_check: --ptx needs a folder")
        ptx_dir, words = words[1], words[2:]
        os.makedirs(ptx_dir, exist_ok=True)
    CASES = [(name, case) for name, case in CASES if not words or any(w in name for w in words)]
    failures = 0
    for name, case in CASES:
        before = len(compiled)
        try:
            case()
            print(f"ok   {name}: {', '.join(compiled[before:]) or '(no kernel launched)'}")
        except Exception:
            failures += 1
            print(f"FAIL {name}:\n{traceback.format_exc(limit=3)}")
    print(f"triton {triton.__version__}: {len(CASES) - failures}/{len(CASES)} cases compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
