"""Replaying rank 0's pool operations on another rank's pools.

Rank 0 owns the allocator (scheduler, radix cache, request table); the other ranks hold pools of the
same geometry and only ever see indices. Outside a step, rank 0 changes pool bytes in four ways --
copy a state slot (copy-on-write restore, snapshot, fork), zero one (a request starting from
nothing), copy KV pages (a fork's own tail), move a block (unified-arena compaction) -- and records
each in `InFlightMemory.ops`.
Each rank replays them, in order, before the next step, so its pools hold exactly what rank 0's
would if they were one: slot i and page j mean the same request state on every rank, each holding
its own heads (TP) or positions (DCP) of it.
"""
from __future__ import annotations


def replay_ops(memory, ops) -> None:
    """`memory`: this rank's SplitPools or UnifiedArena (built from the same RankSetup as rank 0's)."""
    for op in ops:
        kind = op[0]
        if kind == "copy_slot":
            memory.copy_slot(op[1], op[2])
        elif kind == "zero_slot":
            memory.zero_slot(op[1])
        elif kind == "copy_pages":
            memory.copy_pages(op[1], op[2])
        elif kind == "move":
            memory.copy_block(op[1], op[2], op[3])
        else:
            raise ValueError(f"unknown pool operation {op!r}")
