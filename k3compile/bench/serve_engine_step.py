"""The engine's own decode step, for `bench serve --engine-step`: the denominator of the goal ratio
served ITL p50 / engine step, measured in the bench's process on the same lengths.

An LLMEngine (overlap on, prefix cache off) runs B requests of `in_len` random prompt tokens and
`out_len` output tokens for each batch size B. Its executor is wrapped so every forward is timed:
on CUDA with events around it (the device time of the step: the decode graph replay and its input
copies), on a CPU with the wall clock. Per B it reports the median over the decode steps that held
all B requests (`device_step_ms`, what `bench decode` calls the step), and the median wall time of
those `engine.step()` calls (`loop_step_ms`: scheduling, launch, sampling, applying the results,
i.e. the offline engine loop without HTTP), and `prefill_ms`, the time of all prefill forwards of
the B prompts (at B = 1: one prompt's prefill, the yardstick of the TTFT goal).
"""
from __future__ import annotations

import random
import statistics
import time


def engine_steps(source: str, batches: list[int], in_len: int, out_len: int, device: str | None = None,
                 memory_bytes: int | None = None, log=print, provider=None, engine_flags: dict | None = None) -> dict:
    """`provider`: a step provider to run instead of loading `source` (which then only names the
    tokenizer; bench/stand_in_step.py); `engine_flags`: more EngineArgs (the served engine's budget)."""
    import torch

    from k3compile.engine.opened import is_engine_dir
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.sampling import SamplingParams

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    is_engine = is_engine_dir(source)
    engine = LLMEngine(EngineArgs(model=None if is_engine else source, engine_dir=source if is_engine else None,
                                  device=device, memory_bytes=memory_bytes, enable_prefix_cache=False, overlap=True,
                                  max_running=max(batches), **(engine_flags or {})), model=provider)
    ex = engine.runner.executor
    cuda = ex.device.type == "cuda"
    marks: list = []   # (mode, batch size, start, end) events on CUDA, else (mode, batch size, seconds)
    inner = ex.run

    def timed(fb):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(fb)
            end.record()
            marks.append((fb.mode, fb.batch_size, start, end))
        else:
            t = time.perf_counter()
            out = inner(fb)
            marks.append((fb.mode, fb.batch_size, time.perf_counter() - t))
        return out

    ex.run = timed
    doc = {"source": source, "device": device, "input_len": in_len, "output_len": out_len, "batches": {}}
    try:
        engine.warmup()
        for b in batches:
            rng = random.Random(b)
            marks.clear()
            for i in range(b):
                engine.add_request(f"step-{b}-{i}", [rng.randrange(10, 250) for _ in range(in_len)],
                                   SamplingParams(max_new_tokens=out_len, ignore_eos=True))
            walls = []
            while engine.has_unfinished():
                t = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t
                launched = engine._inflight.batch if engine._inflight is not None else None
                if launched is not None and launched.mode == "decode" and len(launched.rows) == b:
                    walls.append(wall)
            if cuda:
                torch.cuda.synchronize()
                ms = [(m, n, s.elapsed_time(e)) for m, n, s, e in marks]
            else:
                ms = [(m, n, sec * 1000.0) for m, n, sec in marks]
            dev = [t for m, n, t in ms if m == "decode" and n == b]
            pre = [t for m, n, t in ms if m == "prefill"]
            entry = {"device_step_ms": statistics.median(dev) if dev else None,
                     "prefill_ms": sum(pre),   # every prefill forward of the B prompts (b = 1: one prompt's prefill)
                     "loop_step_ms": statistics.median(walls) * 1000.0 if walls else None,
                     "decode_steps": len(dev)}
            doc["batches"][str(b)] = entry
            log(f"engine step at batch {b}: device {entry['device_step_ms']} ms, loop {entry['loop_step_ms']} ms "
                f"({len(dev)} steps)")
    finally:
        ex.run = inner
        engine.close()
    return doc
