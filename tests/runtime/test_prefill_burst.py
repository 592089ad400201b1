"""A burst of simultaneous prompts is admitted by the token budget, not one prompt per step: 64
prompts of 128 tokens (8192 prompt tokens) all get their first token within ceil(8192 / budget)
prefill steps, plus one (the prompt tails the cache policy splits off, and the decode tokens that ride
in the prefill steps take budget too) -- counted in steps, on the timed stand-in model at zero cost
(bench/stand_in_step.py), overlap on as in serving."""
import math
import random

import pytest

from k3compile.bench.stand_in_step import TimedStandInModel
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams

PROMPTS, PROMPT_LEN = 64, 128


def burst(budget: int, policy: str = "sparse"):
    model = TimedStandInModel(0.0, 0.0)
    engine = LLMEngine(EngineArgs(model="k3-tiny", device="cpu", overlap=True, enable_unified_memory=True,
                                  memory_bytes=64 << 20, max_batch_tokens=budget, cache_policy=policy),
                       model=model)
    rng = random.Random(0)
    for i in range(PROMPTS):
        engine.add_request(f"r{i}", [rng.randrange(10, 250) for _ in range(PROMPT_LEN)],
                           SamplingParams(max_new_tokens=4, ignore_eos=True))
    first: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first.setdefault(out.rid, len(model.steps))   # forward steps run so far
    engine.close()
    return model.steps, first


@pytest.mark.parametrize("budget", [2048, 8192])
def test_a_burst_prefills_in_budget_sized_steps(budget):
    steps, first = burst(budget)
    assert len(first) == PROMPTS
    full = math.ceil(PROMPTS * PROMPT_LEN / budget)
    prefill = [s for s in steps if s[0] == "prefill"]
    # every prompt had its first token once the prefill steps were run: at most one step beyond the
    # budget's bound (the prompts' last tokens, split off at a checkpoint boundary) and the overlap lag
    assert len(prefill) <= full + 1, prefill
    assert max(first.values()) <= len(prefill) + 1
    # the steps before the last use the whole budget (many prompts per step)
    assert all(tokens == budget for _, _, tokens in prefill[:full - 1]), prefill
    assert max(rows for _, rows, _ in prefill) >= budget // PROMPT_LEN



@pytest.mark.parametrize("policy", ["sparse", "none"])
def test_bound_holds_with_and_without_the_prefix_cache(policy):
    steps, first = burst(2048, policy=policy)
    prefill = [s for s in steps if s[0] == "prefill"]
    assert len(first) == PROMPTS and len(prefill) <= math.ceil(PROMPTS * PROMPT_LEN / 2048) + 1, prefill
