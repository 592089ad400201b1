"""`k3compile serve ENGINE` of an engine built with `--topology tp2` (one compiled engine per rank): the
openai client gets the single-process greedy tokens, through chunked prefill and a prefix-cache hit.
Slow on a CPU: building captures both ranks' graphs."""
import pytest
import torch

from .served import AGAIN, PROMPT, Served, alive, reference


@pytest.fixture(scope="module")
def tp2_engine(tmp_path_factory):
    from k3compile.engine.build import BuildOptions, build_engine
    out = str(tmp_path_factory.mktemp("engines") / "tp2")
    build_engine(BuildOptions("k3-tiny", dtype=torch.float32, topology="tp2", page_size=4), out, log=lambda m: None)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_engine_serves_the_openai_client(tp2_engine):
    want = reference([PROMPT, AGAIN], 6)
    s = Served(tp2_engine)
    try:
        assert len(s.ranks) == 1
        s.check_greedy(want)
    finally:
        _, out = s.stop()  # SIGINT: uvicorn re-raises it once shut down (exit code 1, as any serve)
    assert "shut down:" not in out, out  # no rank failed
    assert not any(alive(p) for p in s.ranks)  # the engine stopped its rank on the way out
