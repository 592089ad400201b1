"""The control channel: rank 0 broadcasts messages (runtime/parallel/messages.py) to the other ranks.

Its own gloo group on the host (as vLLM's cpu_group), so messages never touch the accelerator, with
a timeout long enough that a worker may wait for the next step as long as the server stays idle. A
dead rank 0 still ends the wait at once (its sockets close). Liveness of the workers is watched by
heartbeats (heartbeat.py), not by this channel.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

IDLE_TIMEOUT = datetime.timedelta(days=365)


class ControlChannel:
    def __init__(self):
        # every rank creates it, in the same order relative to the other groups
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, msg) -> None:
        """Rank 0: every other rank receives `msg`."""
        dist.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self):
        """Other ranks: the next message rank 0 sends."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (the tightest rank's capacity)."""
        import torch
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
