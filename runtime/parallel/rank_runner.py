"""Rank 0's model runner for a parallel engine: before each forward, the step goes to the other ranks.

The message is the pool operations recorded since the previous step (InFlightMemory.ops: restores,
snapshots, zeroed slots, compaction moves) and the batch's ForwardBatch on the host; then rank 0
runs its own share of the step, which meets the others' in the step's collectives. Any failure of
a step is fatal here (a RankFailure naming the rank to blame): after a collective failed, no rank
can tell which requests' state is intact on the others. Overlap is off (each step's input ids must
be on the host when the message is sent).
"""
from __future__ import annotations

from k3compile.runtime.model_runner import InFlight, ModelRunner
from k3compile.runtime.scheduler import ScheduledBatch

from .messages import StepMessage, batch_to


class RankZeroRunner(ModelRunner):
    def __init__(self, ranks, provider, memory, max_context: int, **kw):
        super().__init__(provider, memory, max_context, overlap=False, **kw)
        self.ranks = ranks

    def _forward(self, batch: ScheduledBatch, job: InFlight):
        ops, self.memory.ops = self.memory.ops, []
        self.ranks.step(StepMessage(ops, batch_to(batch.forward, "cpu")))
        try:
            return super()._forward(batch, job)
        except Exception as e:
            raise self.ranks.failure(e) from e
