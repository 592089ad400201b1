"""`EngineArgs.step_timing`: every prefill forward is counted with its tokens, host and device seconds (the warm-up's
are forgotten), and metrics()["first_token"] says how many prefill forwards each first token waited for -- the
served TTFT's breakdown (session 13: a 448-token prompt took 3 forwards of 256 + 176 + 16 tokens)."""
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.prefill_timing import PrefillTimer
from k3compile.runtime.sampling import SamplingParams

PROMPT = [(7 * i) % 250 + 1 for i in range(448)]


def _engine(**kw):
    return LLMEngine(EngineArgs(model="k3-tiny", memory_bytes=32 << 20, step_timing=True, **kw))


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def test_timer_counts_forwards_tokens_and_seconds_then_resets():
    t = PrefillTimer(cuda=False)
    for tokens in (256, 176, 16):
        t.stop(t.start(tokens))
    got = t.totals()
    assert (got["forwards"], got["tokens"], got["device_forwards"]) == (3, 448, 3)
    assert got["host_seconds"] >= 0 and got["device_seconds"] == got["host_seconds"]   # CPU: both the wall clock
    t.reset()
    assert t.totals() == {"forwards": 0, "tokens": 0, "host_seconds": 0.0, "device_forwards": 0,
                          "device_seconds": 0.0}


def test_a_448_token_prompt_takes_three_prefill_forwards_and_its_repeat_one():
    """Chunks end at multiples of chunk_size (256) and at the prompt tail's checkpoint boundary (432: the state a
    repeat of the prompt restarts from), so the first token waits for 3 forwards; the repeat computes 16 tokens."""
    eng = _engine()
    try:
        eng.warmup()
        m = eng.metrics()
        assert m["prefill_forward"]["forwards"] == 0 and m["first_token"]["requests"] == 0
        first = eng.generate([PROMPT], _greedy(3))
        m = eng.metrics()
        assert m["prefill_forward"]["forwards"] == 3 and m["prefill_forward"]["tokens"] == 448
        assert m["first_token"]["requests"] == 1 and m["first_token"]["prefill_forwards"] == 3
        assert m["first_token"]["seconds"] > 0 and m["prefill_forward"]["host_seconds"] > 0
        again = eng.generate([PROMPT], _greedy(3))
        assert again == first   # the cache hit changes no token
        m = eng.metrics()
        assert m["prefill_forward"]["forwards"] == 4 and m["prefill_forward"]["tokens"] == 448 + 16
        assert m["first_token"]["requests"] == 2 and m["first_token"]["prefill_forwards"] == 4
    finally:
        eng.close()


def test_a_bigger_chunk_size_cuts_the_forwards_a_first_token_waits_for():
    """serve --chunk-size 2048: the same prompt in 2 forwards (0-432, 432-448), the same tokens."""
    ref = _engine()
    big = _engine(chunk_size=2048)
    try:
        assert big.generate([PROMPT], _greedy(3)) == ref.generate([PROMPT], _greedy(3))
        assert big.metrics()["first_token"]["prefill_forwards"] == 2
        assert big.metrics()["prefill_forward"]["tokens"] == 448
    finally:
        ref.close()
        big.close()


def test_off_means_no_prefill_figures_but_first_tokens_still_counted():
    eng = LLMEngine(EngineArgs(model="k3-tiny", memory_bytes=16 << 20))
    try:
        eng.generate([[5, 6, 7]], _greedy(2))
        m = eng.metrics()
        assert eng.runner.prefill_timer is None and "prefill_forward" not in m
        assert m["first_token"]["requests"] == 1 and m["first_token"]["prefill_forwards"] == 1
    finally:
        eng.close()
