"""A non-zero rank of a parallel engine: join the group, load the rank's steps, then execute what rank 0
broadcasts until it says stop.

    serve_rank(source, rank, device)      # blocks; under torchrun every rank but 0 runs this

The worker holds no scheduler and no cache: rank 0 sizes the pools (RankSetup, from the smallest
budget of all ranks), and every step sends the pool operations since the previous step and the
step's ForwardBatch; the worker replays the one and runs the other on its own pools with the same
Executor the single-process engine uses (same buckets, padding and CUDA graphs, so the ranks take
the same code path and issue the same collectives). Sampling happens on rank 0 only: the logits are
replicated (all-gathered) on every rank, but rank 0 alone holds the requests' sampling state, and
the next step's input ids arrive in its broadcast, so the ranks cannot disagree about a token.

Any error here is fatal for the worker (exit code STEP_FAILED after the traceback on stderr): the
other ranks are then blocked in a collective, and rank 0 reports this rank as the one that failed.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

from k3compile.runtime.executor import Executor
from k3compile.runtime.memory.factory import make_memory
from k3compile.runtime.memory.sizing import pool_budget

from .broadcast import ControlChannel
from .groups import default_backend, env_store, init_rank, shutdown_rank
from .heartbeat import Heartbeat
from .messages import STOP, BudgetQuery, RankSetup, StepMessage, batch_to
from .mirror import replay_ops
from .rank_provider import RankSource, open_rank

STEP_FAILED = 3


def rank_device(device: str, local_rank: int) -> str:
    """Rank r of a CUDA engine runs on cuda:LOCAL_RANK; CPU ranks share the host."""
    return f"cuda:{local_rank}" if str(device).startswith("cuda") else "cpu"


def serve_rank(source: RankSource, rank: int, device: str, timeout_s: float, parent_pid: int | None = None) -> int:
    world = source.world()
    dev = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    store = env_store(rank, world, timeout_s)
    beat = Heartbeat(store, rank, parent_pid).start()
    init_rank(source.parsed_topology(), default_backend(dev), timeout_s, rank=rank, store=store)
    channel = ControlChannel()
    try:
        provider = open_rank(source, rank, dev)
        memory = executor = None
        while True:
            msg = channel.recv()
            if msg == STOP:
                return 0
            if isinstance(msg, BudgetQuery):
                channel.min_over_ranks(pool_budget(dev, msg.mem_fraction_static, msg.memory_bytes).bytes)
            elif isinstance(msg, RankSetup):
                memory = make_memory(provider.cache_spec(), msg.budget_bytes, msg.page_size, msg.unified,
                                     msg.state_fraction, dev)
                executor = Executor(provider, memory.tensors, cuda_graphs=msg.cuda_graphs,
                                    max_context=msg.max_context, pad_to_buckets=msg.pad_to_buckets,
                                    **({"buckets": msg.buckets} if msg.buckets else {}))
            elif isinstance(msg, StepMessage):
                replay_ops(memory, msg.ops)
                executor.run(batch_to(msg.forward, executor.device))
            else:
                raise ValueError(f"unexpected message from rank 0: {type(msg).__name__}")
    finally:
        beat.stop()
        shutdown_rank()


def worker_main(source: RankSource, rank: int, env: dict, device: str, timeout_s: float, parent_pid: int) -> None:
    """Entry point of a worker process the engine started itself (multiprocessing target)."""
    os.environ.update(env)
    if not str(device).startswith("cuda"):
        torch.set_num_threads(1)  # the ranks share the host's cores
    try:
        code = serve_rank(source, rank, device, timeout_s, parent_pid)
    except BaseException:
        sys.stderr.write(f"k3compile rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(STEP_FAILED)
    os._exit(code)
