"""Runs scheduled batches: the forward through the executor, the batch's snapshot copies, then the
sampling pass, all launched as one unit of work.

The forward and the copies after it run in order, like kernels on one stream: a snapshot copy sees
the forward that ended at its position, and the next batch's forward (which overwrites the working
slot) comes after the copy. The sampling pass is launched right behind them, before anything else
can be launched, so it reads a CUDA graph's static logits before the next replay overwrites them.

`launch(batch, prev)` returns an InFlight at once on CUDA (kernels are queued, the sampled ids are
copied to pinned memory behind an event); with `overlap` on a CPU the unit runs on one worker
thread (the CPU stand-in for the device's stream). `InFlight.result()` waits for it.

Placeholders. With overlap, batch N+1 is launched before batch N's tokens reached the host: a
decode row whose input token batch N samples reads it from N's device tensor of sampled ids (a
gather on the device, queued behind N's sampling). `sources` says which: {input_ids index: index
row of prev that samples it}; the other placeholders are filled from the host (tokens already processed).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from k3compile.runtime.executor import Executor

from .batch_sampling import BatchSample, PendingSample, sample_batch
from .decode_timing import DecodeTimer
from .prefill_timing import PrefillTimer
from .inflight_memory import InFlightMemory
from .sampler import to_device
from .scheduler import ScheduledBatch


class InFlight:
    """One launched batch: its forward, copies and sampling pass. `result()` -> (BatchSample, {row:
    why}) once the ids are on the host; raises what the forward raised."""

    def __init__(self, batch: ScheduledBatch):
        self.batch = batch
        self.pending: PendingSample | None = None  # set once the sampling pass is launched
        self.error: BaseException | None = None  # what the forward raised
        self.row_errors: dict[int, str] = {}  # rows whose sampling raised alone (per-row fallback)
        self.fallback: BatchSample | None = None
        self.features: torch.Tensor | None = None  # target features of every computed token, for a drafter
        self._future: Future | None = None

    def result(self) -> tuple[BatchSample, dict[int, str]]:
        if self._future is not None:
            self._future.result()
        if self.error is not None:
            raise self.error
        if self.fallback is not None:
            return self.fallback, dict(self.row_errors)
        sampled, errors = self.pending.result()
        errors.update(self.row_errors)
        return sampled, errors


class ModelRunner:
    def __init__(self, provider, memory: InFlightMemory, max_context: int, overlap: bool = False,
                 cuda_graphs: bool | None = None, buckets=None, pad_to_buckets: bool | None = None,
                 step_timing: bool = False):
        """`step_timing`: time every decode forward per batch bucket (`self.timer`, runtime/decode_timing.py)
        and every prefill forward's host and device time (`self.prefill_timer`, runtime/prefill_timing.py)."""
        self.memory = memory
        self.executor = Executor(provider, memory.tensors, cuda_graphs=cuda_graphs, max_context=max_context,
                                 pad_to_buckets=pad_to_buckets, **({"buckets": buckets} if buckets else {}))
        cuda = self.executor.device.type == "cuda"
        self.timer = DecodeTimer(cuda) if step_timing else None
        self.prefill_timer = PrefillTimer(cuda) if step_timing else None
        # on CUDA the launch itself is asynchronous; on a CPU a worker thread stands in for the stream
        threaded = overlap and self.executor.device.type != "cuda"
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="k3-forward") if threaded else None

    def _forward(self, batch: ScheduledBatch, job: InFlight) -> torch.Tensor:
        fb = batch.forward
        timer = None
        if self.timer is not None and fb.mode == "decode":
            timer, mark = self.timer, self.timer.start(self.executor.decode_size(fb.batch_size))
        elif self.prefill_timer is not None and fb.mode == "prefill":
            timer, mark = self.prefill_timer, self.prefill_timer.start(int(fb.input_ids.shape[0]))
        with torch.no_grad():
            out = self.executor.run(fb)
            if timer is not None:
                timer.stop(mark)
            for working, snap in batch.snapshot_copies:
                self.memory.copy_slot(working, snap)
        if isinstance(out, tuple):  # the executor emits target features (a speculative drafter reads them)
            out, job.features = out
        return out

    def launch(self, batch: ScheduledBatch, prev: InFlight | None = None,
               sources: dict[int, int] | None = None) -> InFlight:
        """Queue the batch's forward and sampling; `prev`/`sources`: placeholders read from the
        previous batch's sampled ids on the device (module docstring)."""
        job = InFlight(batch)

        def work():
            try:
                if sources:
                    self._fill_from(batch, prev, sources)
                logits = self._forward(batch, job)
            except Exception as e:
                job.error = e
                return
            self._sample(job, logits)

        if self._worker is None:
            work()
        else:
            job._future = self._worker.submit(work)
        return job

    def run(self, batch: ScheduledBatch) -> InFlight:
        """Launch without overlap (placeholders, if any, filled by the caller)."""
        job = InFlight(batch)
        try:
            logits = self._forward(batch, job)
        except Exception as e:
            job.error = e
            return job
        self._sample(job, logits)
        return job

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> tuple[BatchSample, dict[int, str]]:
        """Sample `logits` for `batch` and wait: (BatchSample, {row: why}) (the speculative
        decoder's anchor rows, which it needs on the host at once)."""
        job = InFlight(batch)
        self._sample(job, logits)
        return job.result()

    @staticmethod
    def _fill_from(batch: ScheduledBatch, prev: InFlight | None, sources: dict[int, int]) -> None:
        """sources: {input_ids index: row of prev whose sampled token goes there}."""
        if prev is None or prev.error is not None:
            return  # prev failed: the rows waiting for it are zombies or void (their tokens stay 0)
        ids = batch.forward.input_ids
        if prev.fallback is not None:  # prev was sampled row by row: its tokens are on the host already
            pairs = [(d, prev.fallback.tokens[i]) for d, i in sources.items() if prev.fallback.tokens[i] is not None]
            if pairs:
                ids.index_copy_(0, to_device([d for d, _ in pairs], torch.int64, ids.device),
                                to_device([t for _, t in pairs], ids.dtype, ids.device))
            return
        pending = prev.pending
        pairs = [(d, pending.token_index[i]) for d, i in sources.items() if i in pending.token_index]
        if not pairs:
            return  # nothing sampled for them (finished meanwhile): zombies
        dst = to_device([d for d, _ in pairs], torch.int64, ids.device)
        src = to_device([k for _, k in pairs], torch.int64, ids.device)
        ids.index_copy_(0, dst, pending.tokens.index_select(0, src).to(ids.dtype))

    @staticmethod
    def _sample(job: InFlight, logits: torch.Tensor) -> None:
        """Tokens (and logprobs) for every sampling row of a live request, in one batched pass. If
        the batched pass raises, each row is sampled alone (and waited for), so only the requests
        whose own sampling fails fail; the others go on."""
        batch = job.batch
        try:
            job.pending = sample_batch(batch, logits)
            return
        except Exception:
            pass
        n = len(batch.rows)
        out, errors = BatchSample([None] * n, [None] * n), {}
        for i in range(n):
            alone = replace(batch, rows=[r if j == i else replace(r, samples=False) for j, r in enumerate(batch.rows)])
            try:
                one, errs = sample_batch(alone, logits).result()
            except Exception as e:  # this request's parameters or logits
                errors[i] = f"sampling failed: {e!r}"
                continue
            if i in errs:
                errors[i] = errs[i]
                continue
            out.tokens[i], out.logprobs[i] = one.tokens[i], one.logprobs[i]
            if i in one.forks:
                out.forks[i] = one.forks[i]
            if i in one.prompt_logprobs:
                out.prompt_logprobs[i] = one.prompt_logprobs[i]
        job.fallback, job.row_errors = out, errors

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
