"""serve with DSpark speculation over HTTP, through the official openai client, on the trained tiny pair:
greedy text equals plain greedy decoding; streaming hands out the tokens each verify step commits
(several tokens in one chunk); max_tokens and stop strings cut exactly where decoding without
speculation cuts them."""
import pytest

from k3compile.generate import generate_ids
from k3compile.runtime.sampling import SamplingParams
from tests.runtime.server.conftest import RunningServer
from tests.runtime.spec.test_dspark_engine import DRAFTER, TARGET

PROMPT = "def f(x):\n    return x"
N = 30


@pytest.fixture(scope="module")
def spec_server():
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.server.app import build_app
    from k3compile.runtime.server.async_engine import AsyncEngine

    engine = LLMEngine(EngineArgs(model=TARGET, speculative="dspark", draft=DRAFTER, num_speculative_tokens=4,
                                  memory_bytes=1 << 22, page_size=16, chunk_size=32))
    front = AsyncEngine(engine)
    s = RunningServer(build_app(front, "spec-tiny", api_key="sk-k3compile-test"), front, engine.tokenizer)
    yield s, engine
    s.stop()


@pytest.fixture(scope="module")
def plain(spec_server):
    _, engine = spec_server
    ids = generate_ids(engine.provider, engine.tokenizer.encode(PROMPT), SamplingParams(max_new_tokens=N))
    return engine.tokenizer.decode(ids)


def test_stream_equals_plain_greedy_and_commits_blocks(spec_server, plain):
    server, engine = spec_server
    before = engine.spec.stats.committed
    chunks = [c.choices[0].text for c in server.client().completions.create(
        model="spec-tiny", prompt=PROMPT, max_tokens=N, temperature=0, stream=True) if c.choices and c.choices[0].text]
    assert "".join(chunks) == plain
    assert engine.spec.stats.committed > before and len(chunks) < N  # tokens of one verify arrive together
    server.wait_idle()


@pytest.mark.parametrize("max_tokens", [1, 3, 7])
def test_max_tokens_cut_exactly(spec_server, plain, max_tokens):
    server, _ = spec_server
    r = server.client().completions.create(model="spec-tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert r.choices[0].text == plain[:max_tokens]  # byte-level: one token per character here
    assert r.usage.completion_tokens == max_tokens and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_exactly(spec_server, plain, stream):
    server, _ = spec_server
    stop = plain[12:15]
    want = plain[: plain.index(stop)]
    r = server.client().completions.create(model="spec-tiny", prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop],
                                           stream=stream)
    if stream:
        got = "".join(c.choices[0].text for c in r if c.choices)
    else:
        got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert reason == "stop"
    assert got == want
    server.wait_idle()
