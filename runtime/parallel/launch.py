"""Start one process per rank, run a function in each, and collect the results, or fail clearly.

The parent picks a free TCP port and sets the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) for each child, so the rank code is the same under `torchrun`. A rank
that raises, dies, or does not finish within `timeout_s` raises `RankFailure` naming it; the other
ranks are terminated (then killed) so nothing is left hanging.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch

from k3compile.runtime.fatal import FatalEngineError


class RankFailure(FatalEngineError):
    """A rank of a parallel run raised, died or hung (`rank` None: a collective failed and no rank
    could be blamed)."""

    def __init__(self, rank: int | None, why: str):
        super().__init__(f"rank {rank}: {why}" if rank is not None else f"parallel engine: {why}")
        self.rank, self.why = rank, why


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _child(fn, rank: int, env: dict, args: tuple, results) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        out = fn(rank, *args)
        results.put((rank, "ok", _dumps(out)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)


def launch(fn, world: int, args: tuple = (), timeout_s: float = 120.0, start_method: str | None = None) -> list:
    """Run fn(rank, *args) in `world` processes; returns their results in rank order.

    `fn` must be importable (a module-level function) unless the start method is fork (the default on
    Linux for CPU runs: children share the parent's imports, so starting eight ranks takes no time).
    Use "spawn" whenever the parent has touched CUDA."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, rank_env(r, world, port), args, results), daemon=True,
                         name=f"k3-rank{r}") for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, status, payload = results.get(timeout=0.2)
                if status == "error":
                    errors[rank] = payload
                else:
                    out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
            if dead or errors:
                _drain(results, errors, out)
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
                # a rank that died silently is the cause; the others' collective errors are its symptoms
                if dead:
                    also = f" (then {sorted(errors)} failed in collectives)" if errors else ""
                    raise RankFailure(dead[0], f"process exited with code {procs[dead[0]].exitcode} before "
                                               f"finishing{also}")
                first = min(errors)
                raise RankFailure(first, "raised\n" + errors[first])
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in out]
                raise RankFailure(missing[0], f"no result within {timeout_s:g}s (ranks {missing} unfinished)")
    finally:
        stop(procs)
    return [out[r] for r in range(world)]


def _drain(results, errors: dict, out: dict, settle_s: float = 1.0) -> None:
    """Take what is still in flight (the first error often arrives before the exit codes of its cause)."""
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = payload
        else:
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)


def stop(procs, grace_s: float = 3.0) -> None:
    """Terminate the processes still alive, then kill those that ignore it."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)
