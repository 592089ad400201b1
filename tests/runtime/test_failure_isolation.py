"""A failure inside a step fails only the request that caused it; the engine keeps serving.

An injected fault: a provider (the real k3-tiny model underneath) that raises in the forward, or
returns non-finite logits, for any request whose tokens hold POISON. The poisoned request must end
with finish_reason "error", every other request must produce exactly the tokens a clean engine
produces (up to reference ties), and the engine must serve the next request and end idle.
"""
import random

import pytest

from k3compile.model_def.loader import load_model
from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import GREEDY, assert_greedy_equal_up_to_ties, check_idle, make_engine, reference_generate

POISON = 255  # a byte no victim prompt holds (they draw from 0..199)
TIE = 1e-4


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", seed=0)


class Poisoned:
    """The model as a step provider, with a fault for requests whose new tokens hold POISON:
    `mode="raise"` raises in the forward, `mode="nan"` returns NaN logits for that request."""

    def __init__(self, model, mode: str):
        self.model, self.mode, self.config = model, mode, model.config
        self.device = next(model.parameters()).device

    def cache_spec(self):
        return self.model.cache_spec()

    def step_tensors(self, mode, input_ids, cu_seqlens, *rest):
        logits = self.model.step_tensors(mode, input_ids, cu_seqlens, *rest)
        cu = cu_seqlens.tolist()
        hit = [r for r in range(len(cu) - 1) if (input_ids[cu[r]:cu[r + 1]] == POISON).any()]
        if hit and self.mode == "raise":
            raise RuntimeError("injected forward failure")
        for r in hit:
            logits[r] = float("nan")
        return logits


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 200) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def run(engine, items):
    """items: (rid, prompt, params); returns {rid: (tokens, finish_reason, error)}."""
    for rid, prompt, params in items:
        engine.add_request(rid, prompt, params)
    out = {rid: ([], None, None) for rid, _, _ in items}
    while engine.has_unfinished():
        for o in engine.step():
            toks, _, _ = out[o.rid]
            out[o.rid] = (toks + o.new_token_ids, o.finish_reason, o.error)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_forward_fails_only_its_request(model, overlap):
    """The poisoned request shares its first batch: every request of it is recomputed and isolated,
    then the poisoned one fails alone."""
    victims = prompts(3)
    engine = make_engine(Poisoned(model, "raise"), overlap=overlap, memory_bytes=8 << 20)
    items = [(f"v{i}", p, GREEDY) for i, p in enumerate(victims)]
    items.insert(1, ("bad", [7, 8, POISON], GREEDY))
    out = run(engine, items)
    toks, reason, error = out["bad"]
    assert reason == "error" and "injected forward failure" in error
    got = [out[f"v{i}"][0] for i in range(len(victims))]
    assert all(out[f"v{i}"][1] == "length" and out[f"v{i}"][2] is None for i in range(len(victims)))
    refs = [reference_generate(model, p, GREEDY.max_new_tokens) for p in victims]
    assert_greedy_equal_up_to_ties(model, victims, got, refs, TIE)
    # and it keeps serving
    again = run(engine, [("after", victims[0], GREEDY)])
    assert again["after"][1] == "length" and again["after"][0] == got[0]
    check_idle(engine)
    engine.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_sampling_fails_only_its_request(model, overlap):
    victims = prompts(3, seed=1)
    engine = make_engine(Poisoned(model, "nan"), overlap=overlap, memory_bytes=8 << 20)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    items = [(f"v{i}", p, GREEDY) for i, p in enumerate(victims)] + [("bad", [1, 2, POISON], sampled)]
    out = run(engine, items)
    assert out["bad"][1] == "error" and "non-finite logits" in out["bad"][2]
    got = [out[f"v{i}"][0] for i in range(len(victims))]
    refs = [reference_generate(model, p, GREEDY.max_new_tokens) for p in victims]
    assert_greedy_equal_up_to_ties(model, victims, got, refs, TIE)
    check_idle(engine)
    engine.close()


def test_a_lone_failure_does_not_isolate_anyone(model):
    """Alone in its batch, the poisoned request is the cause at once: nobody else is retracted."""
    engine = make_engine(Poisoned(model, "raise"), memory_bytes=8 << 20)
    out = run(engine, [("bad", [POISON, 1, 2], GREEDY)])
    assert out["bad"][1] == "error"
    assert engine.scheduler.retractions == 0
    check_idle(engine)
    engine.close()


def test_generate_raises_the_request_error(model):
    engine = make_engine(Poisoned(model, "raise"), memory_bytes=8 << 20)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        engine.generate([[POISON, 3]], GREEDY)
    got = engine.generate([[3, 4]], GREEDY)
    assert_greedy_equal_up_to_ties(model, [[3, 4]], got, [reference_generate(model, [3, 4], 12)], TIE)
    engine.close()
