"""A real server for the end-to-end tests: k3-tiny's LLMEngine behind the app, run by uvicorn on a
thread of this process on a free loopback port, with an API key. In-process so tests can also read
the engine's published metrics (`front.metrics()`), the figures /metrics exports."""
import socket
import threading
import time

import pytest

API_KEY = "sk-k3compile-test"
MODEL = "k3-tiny"


class RunningServer:
    def __init__(self, app, front, tokenizer):
        self.app, self.front, self.tokenizer = app, front, tokenizer
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))   # bound before uvicorn starts: no race for the port
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        import uvicorn

        from k3compile.runtime.server.edge import server_config
        self.server = uvicorn.Server(server_config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def async_client(self, **kw):
        import openai
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The engine's metrics once it holds no request (aborts take an engine step to land)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.front.metrics()
            if m.get("in_flight") == 0 and m.get("running") == 0 and m.get("queued") == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout}s: {m}")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def start_server(api_key=API_KEY, **engine_kw) -> RunningServer:
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.server.app import build_app
    from k3compile.runtime.server.async_engine import AsyncEngine

    engine = LLMEngine(EngineArgs(**{"model": MODEL, **engine_kw}))
    front = AsyncEngine(engine)
    return RunningServer(build_app(front, MODEL, api_key=api_key), front, engine.tokenizer)


@pytest.fixture(scope="package")
def server():
    s = start_server()
    yield s
    s.stop()


@pytest.fixture(scope="package")
def reference():
    """Offline greedy generation with the same weights (the engine's preset seed 0): `ref(ids, n)`."""
    from k3compile.generate import generate_ids
    from k3compile.model_def.loader import load_model
    from k3compile.runtime.sampling import SamplingParams

    model = load_model(MODEL, seed=0)
    eos = model.config.eos_token_id
    cache = {}

    def ref(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            cache[key] = generate_ids(model, prompt_ids, SamplingParams(max_new_tokens=max_tokens), eos_token_id=eos)
        return cache[key]

    return ref


@pytest.fixture(scope="package")
def ref_logits():
    """The CPU reference model's raw logits at every position of `ids` (one prefill): `ref_logits(ids)` -> [T, V]."""
    import torch

    from k3compile.model_def.batch import ForwardBatch
    from k3compile.model_def.cache import CacheTensors
    from k3compile.model_def.loader import load_model

    model = load_model(MODEL, seed=0)
    page = 16

    @torch.no_grad()
    def run(ids: list[int]) -> torch.Tensor:
        n_pages = -(-len(ids) // page)
        cache = CacheTensors.allocate(model.cache_spec(), 2, n_pages + 1, page)
        batch = ForwardBatch.build("prefill", [ids], [0], [list(range(1, n_pages + 1))], [1], page, logits="all")
        return model.step(batch, cache).float()

    return run
