"""Rank 0's handle on the other ranks of a parallel engine: start them, size and set them up, send each
step, watch them, stop them.

    ranks = RankGroup(RankSource(engine_dir="engines/tp2"), device="cpu", timeout_s=60)
    ranks.provider                      # rank 0's own steps (the engine runs them like any provider)
    budget = ranks.agree_budget(...)    # the smallest rank's pool budget
    ranks.setup(RankSetup(...)); ranks.step(StepMessage(ops, batch)); ranks.check(); ranks.close()

Starting. Under torchrun (WORLD_SIZE > 1 in the environment) every process runs the same command;
this process must be rank 0 and the others run `serve_rank`. Otherwise the engine starts ranks
1..N-1 itself, one process each, with the torchrun variables set, so the rank code is the same.

Failures. `check()` (cheap; the server calls it every iteration, also when idle) and `failure(exc)`
(after a step or collective raised) name the rank that is to blame: a rank whose process exited
(with its exit code), else one whose heartbeat stopped for `timeout_s / 2` (hung). Every collective
has the process-group timeout `timeout_s`, so a hung rank surfaces within it; a killed one at once
(its sockets close). `close()` stops the workers (terminate, then kill) so none outlives the engine.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from .broadcast import ControlChannel
from .groups import default_backend, env_store, init_rank, shutdown_rank
from .heartbeat import HeartbeatWatch
from .launch import RankFailure, free_port, rank_env, stop
from .messages import STOP, BudgetQuery, RankSetup, StepMessage
from .rank_provider import RankSource, open_rank
from .rank_worker import STEP_FAILED, rank_device, worker_main

CHECK_EVERY_S = 0.5  # how often check() reads the heartbeats
DIAGNOSE_S = 3.0  # how long failure() waits for the culprit's exit code to show


class RankGroup:
    def __init__(self, source: RankSource, device: str = "cpu", timeout_s: float = 60.0):
        self.source, self.timeout_s = source, timeout_s
        source.check()
        self.world = source.world()
        self.procs: list = []  # [rank - 1]: the worker processes this engine started (none under torchrun)
        self.broken: RankFailure | None = None
        self.watch: HeartbeatWatch | None = None  # once the group is up
        self.channel: ControlChannel | None = None
        self._next_check = 0.0
        torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun started every rank
        if torchrun and int(os.environ.get("RANK", "0")) != 0:
            raise RuntimeError("only rank 0 runs the engine; the other ranks run serve_rank")
        dev = rank_device(device, int(os.environ.get("LOCAL_RANK", 0)))
        # rank 0's steps first: forked ranks then inherit every module loading them imported (seconds each)
        self.provider = open_rank(source, 0, dev)
        addr, port = (None, None) if torchrun else ("127.0.0.1", self._start_workers(device))
        try:
            store = env_store(0, self.world, timeout_s, addr, port)
            init_rank(source.parsed_topology(), default_backend(dev), timeout_s, rank=0, store=store)
            self.channel = ControlChannel()
            self.watch = HeartbeatWatch(store, range(1, self.world), hang_s=timeout_s / 2)
        except Exception as e:
            failure = self.failure(e)
            self.close()
            raise failure from e

    def _start_workers(self, device: str) -> int:
        """Start ranks 1..N-1 (torchrun's variables set for each); returns the rendezvous port."""
        port = free_port()
        cuda = str(device).startswith("cuda")
        ctx = mp.get_context("spawn" if cuda or "fork" not in mp.get_all_start_methods() else "fork")
        for r in range(1, self.world):
            p = ctx.Process(target=worker_main, name=f"k3-rank{r}", daemon=True,
                            args=(self.source, r, rank_env(r, self.world, port), device, self.timeout_s, os.getpid()))
            p.start()
            self.procs.append(p)
        return port

    # ---- set-up ----
    def agree_budget(self, mem_fraction_static, memory_bytes, local_bytes: int) -> int:
        """Every rank sizes its own budget; all get the smallest (the tightest rank decides capacity)."""
        self._send(BudgetQuery(mem_fraction_static, memory_bytes))
        return self._guard(lambda: self.channel.min_over_ranks(local_bytes))

    def setup(self, setup: RankSetup) -> None:
        self._send(setup)

    def step(self, msg: StepMessage) -> None:
        self._send(msg)

    def _send(self, msg) -> None:
        self._guard(lambda: self.channel.send(msg))

    def _guard(self, fn):
        if self.broken is not None:
            raise self.broken
        try:
            return fn()
        except Exception as e:
            raise self.failure(e) from e

    # ---- health ----
    def check(self) -> None:
        """Raise RankFailure if a rank died or stopped beating (at most every CHECK_EVERY_S)."""
        if self.broken is not None:
            raise self.broken
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        found = self._culprit()
        if found is not None:
            self.broken = found
            raise found

    def _culprit(self) -> RankFailure | None:
        dead = {r: p.exitcode for r, p in enumerate(self.procs, 1) if p.exitcode is not None}
        if dead:
            # a rank that failed on its own (a signal, an error of its own) before those that followed it
            r = min(dead, key=lambda r: (dead[r] == STEP_FAILED, r))
            code = dead[r]
            why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            also = f" (ranks {sorted(set(dead) - {r})} exited too)" if len(dead) > 1 else ""
            return RankFailure(r, f"process {why}{also}")
        if self.watch is None:
            return None
        try:
            stale = self.watch.stale()
        except Exception as e:  # the store itself failed: rank 0's own problem, not a rank's
            return RankFailure(0, f"cannot read the ranks' heartbeats: {e!r}")
        if stale:
            r = max(stale, key=stale.get)
            return RankFailure(r, f"hung: no heartbeat for {stale[r]:.0f}s")
        return None

    def failure(self, exc: BaseException) -> RankFailure:
        """The RankFailure behind `exc` (raised by a step or a collective on rank 0)."""
        if isinstance(exc, RankFailure):
            self.broken = self.broken or exc
            return exc
        if self.broken is not None:
            return self.broken
        end = time.monotonic() + DIAGNOSE_S  # the culprit's exit code may lag the error it caused
        found = self._culprit()
        while found is None and time.monotonic() < end:
            time.sleep(0.1)
            found = self._culprit()
        if found is None:
            found = RankFailure(0, f"the step failed, and no other rank is dead or hung: {exc!r}")
        else:
            found = RankFailure(found.rank, f"{found.why}; rank 0 saw: {exc!r}")
        self.broken = found
        return found

    # ---- stop ----
    def close(self) -> None:
        """Tell the workers to stop (if they can still hear it), then make sure they are gone."""
        if self.broken is None and self.channel is not None:
            try:
                self.channel.send(STOP)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()) if self.broken is None else 0.0)
        stop(self.procs)
        self.procs = []
        try:
            shutdown_rank()
        except Exception:  # a group broken by the failure: the process is done with it either way
            pass
