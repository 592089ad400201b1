"""Bench results as files (docs/BENCHMARKS.md rule 6): the environment, JSON, and a markdown table."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess

import torch


def environment(device: torch.device) -> dict:
    import k3compile

    env = {"python": platform.python_version(), "torch": torch.__version__, "k3compile": k3compile.__version__,
           "git_commit": git_commit(), "host": platform.node(), "cpu_threads": torch.get_num_threads()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["device"] = {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
                         "memory_bytes": p.total_memory, "sm_count": p.multi_processor_count,
                         "cuda": torch.version.cuda}
    else:
        env["device"] = {"type": device.type, "name": platform.processor() or platform.machine()}
    from k3compile.model_def.ops.cuda_backend import BACKENDS
    env["k3_op_backends"] = dict(BACKENDS)
    return env


def git_commit() -> str | None:
    """HEAD of the repository this package runs from (with '-dirty' when the tree has changes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _finite(x):
    """JSON has no NaN/inf: a broken arm's non-finite numbers are written as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(doc), f, indent=1, allow_nan=False, default=str)
        f.write("\n")
    os.replace(tmp, path)  # a run killed mid-write keeps the previous complete file


def read_json(path: str) -> dict:
    """A report written by write_json, or its gzipped copy `path`.gz (large reports are committed under traces/
    compressed, to keep the repository small)."""
    import gzip
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", "rt") as f:
            return json.load(f)
    with open(path) as f:
        return json.load(f)


def report_exists(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(path + ".gz")


DEFAULT_OUT_ROOT = "bench_out"


def fresh_out_dir(bench: str, out: str | None) -> str:
    """`out` if given; else a new folder bench_out/<bench>-<UTC time> (never overwriting earlier
    results, e.g. the ones committed under traces/). Created, and announced on stdout."""
    if out is None:
        import time
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        out, n = os.path.join(DEFAULT_OUT_ROOT, f"{bench}-{stamp}"), 1
        while os.path.exists(out):
            n += 1
            out = os.path.join(DEFAULT_OUT_ROOT, f"{bench}-{stamp}-{n}")
    os.makedirs(out, exist_ok=True)
    print(f"bench {bench}: results go to {out}/", flush=True)
    return out
