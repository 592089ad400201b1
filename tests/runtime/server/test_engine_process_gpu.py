"""On CUDA: the engine built and stepped in a spawned child process (`serve --engine-process`) serves
the same greedy tokens as the engine on a thread, a chunk per step, and warms up before /health."""
import functools
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_engine_process_on_cuda_streams_what_the_thread_does():
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.server.app import build_app
    from k3compile.runtime.server.async_engine import AsyncEngine

    from .conftest import MODEL, RunningServer

    args = EngineArgs(model=MODEL, device="cuda", memory_bytes=64 << 20)
    streams = []
    for process in (False, True):
        front = AsyncEngine.spawn(functools.partial(LLMEngine, args)) if process else AsyncEngine(LLMEngine(args))
        server = RunningServer(build_app(front, MODEL, api_key=None), front, front.tokenizer)
        try:
            deadline = time.monotonic() + 300
            while front.health() is not None:   # warming up (CUDA graphs, kernels) in the child
                assert time.monotonic() < deadline, front.health()
                time.sleep(0.1)
            chunks = [c for c in server.client().completions.create(
                model=MODEL, prompt=[65, 66, 67, 68, 69], max_tokens=24, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True}) if c.choices]
            assert len(chunks) == 24   # a chunk per step
            streams.append([t for c in chunks for t in c.choices[0].token_ids])
            assert front.warmup_report is not None and "error" not in front.warmup_report
        finally:
            server.stop()
    assert streams[0] == streams[1]
