"""What rank 0 tells the other ranks of a parallel engine, in order, over the control channel.

    BudgetQuery  once: every rank sizes its pools' budget from its own device; all reduce to the smallest
    RankSetup    once, before the first step: how to size the pools and the executor (rank 0 decided
                 them, from the tightest rank's memory), so every rank's pools have the same
                 geometry and the scheduler's slot and page indices are valid on all of them
    StepMessage  every step: the pool operations since the last step, then the step's batch
                 metadata -- the ForwardBatch the single-process executor consumes, on the host
    STOP         the server is shutting down
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from k3compile.model_def.batch import ForwardBatch

STOP = "stop"


@dataclass(frozen=True)
class BudgetQuery:
    mem_fraction_static: float | None
    memory_bytes: int | None


@dataclass(frozen=True)
class RankSetup:
    unified: bool  # one arena (--enable-unified-memory) or split pools
    budget_bytes: int  # the pools' bytes on every rank: the smallest rank's budget
    page_size: int  # tokens per runtime page
    state_fraction: float  # split pools: the state slots' share
    max_context: int
    cuda_graphs: bool | None
    buckets: tuple[int, ...] | None
    pad_to_buckets: bool | None


@dataclass
class StepMessage:
    ops: list  # pool operations since the last step (InFlightMemory.ops), replayed before the step
    forward: ForwardBatch


def batch_to(fb: ForwardBatch, device) -> ForwardBatch:
    """The same batch with its tensors on `device` (host copies for the wire, device copies to run)."""
    moved = {f.name: getattr(fb, f.name).to(device) for f in fields(fb)
             if isinstance(getattr(fb, f.name), torch.Tensor)}
    return replace(fb, **moved)
