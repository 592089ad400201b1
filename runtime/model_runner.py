"""Runs scheduled batches: the forward through the executor, then the batch's snapshot copies, then sampling.

The forward and the copies after it are one unit of work, executed in order, like kernels on one
stream: a snapshot copy sees the forward that ended at its position, and the next batch's forward
(which overwrites the working slot) comes after the copy. With `overlap`, that unit runs on a
single worker thread (the CPU stand-in for the device's stream) while the scheduler prepares the
next batch; `launch` returns at once and `wait` returns the logits.

Logits of a CUDA-graph replay are a view of the graph's static output: they are sampled before the
next batch is launched, which the engine's loop guarantees.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from k3compile.runtime.executor import Executor

from .batch_sampling import BatchSample, sample_batch
from .inflight_memory import InFlightMemory
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, provider, memory: InFlightMemory, max_context: int, overlap: bool = False,
                 cuda_graphs: bool | None = None, buckets=None, pad_to_buckets: bool | None = None):
        self.memory = memory
        self.executor = Executor(provider, memory.tensors, cuda_graphs=cuda_graphs, max_context=max_context,
                                 pad_to_buckets=pad_to_buckets, **({"buckets": buckets} if buckets else {}))
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="k3-forward") if overlap else None
        self._future: Future | None = None

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        with torch.no_grad():
            logits = self.executor.run(batch.forward)
            for working, snap in batch.snapshot_copies:
                self.memory.copy_slot(working, snap)
        return logits

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        return self._forward(batch)

    def launch(self, batch: ScheduledBatch) -> None:
        if self._future is not None:
            raise RuntimeError("a batch is already in flight")
        if self._worker is None:
            raise RuntimeError("launch needs a runner built with overlap=True")
        self._future = self._worker.submit(self._forward, batch)

    def wait(self) -> torch.Tensor:
        fut, self._future = self._future, None
        if fut is None:
            raise RuntimeError("no batch in flight")
        return fut.result()

    @staticmethod
    def sample(batch: ScheduledBatch, logits: torch.Tensor) -> tuple[BatchSample, dict[int, str]]:
        """Tokens (and logprobs) for every sampling row of a live request, in one batched pass, and
        {row: why} for rows whose sampling failed. If the batched pass raises, each row is sampled
        alone, so only the requests whose own sampling fails fail; the others go on."""
        try:
            return sample_batch(batch, logits), {}
        except Exception:
            pass
        n = len(batch.rows)
        out, errors = BatchSample([None] * n, [None] * n), {}
        for i in range(n):
            alone = replace(batch, rows=[r if j == i else replace(r, samples=False) for j, r in enumerate(batch.rows)])
            try:
                one = sample_batch(alone, logits)
            except Exception as e:  # this request's parameters or logits
                errors[i] = f"sampling failed: {e!r}"
                continue
            out.tokens[i], out.logprobs[i] = one.tokens[i], one.logprobs[i]
            if i in one.forks:
                out.forks[i] = one.forks[i]
            if i in one.prompt_logprobs:
                out.prompt_logprobs[i] = one.prompt_logprobs[i]
        return out, errors

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
