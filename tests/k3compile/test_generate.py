"""generate_ids (one request through the LLMEngine) against the plain model.step loop."""
import random

import pytest

from k3compile.generate import generate_ids
from k3compile.model_def.loader import load_model
from k3compile.runtime.sampling import SamplingParams
from tests.runtime.engine_helpers import reference_generate


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny")


def test_generate_ids_matches_reference_and_stops(model):
    rng = random.Random(41)
    prompt = [rng.randrange(256) for _ in range(70)]
    ref = reference_generate(model, prompt, 10)
    seen = []
    assert generate_ids(model, prompt, SamplingParams(max_new_tokens=10), chunk_size=24, on_token=seen.append) == ref
    assert seen == ref
    # eos stops (and is returned) unless ignore_eos
    eos = ref[4]
    cut = ref[: ref.index(eos) + 1]
    assert generate_ids(model, prompt, SamplingParams(max_new_tokens=10), eos_token_id=eos) == cut
    assert generate_ids(model, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True), eos_token_id=eos) == ref
    assert generate_ids(model, [3], SamplingParams(max_new_tokens=2), page_size=1) == reference_generate(model, [3], 2)


def test_generate_ids_rejects_bad_input(model):
    with pytest.raises(ValueError, match="empty"):
        generate_ids(model, [], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the context length"):
        generate_ids(model, [1] * 4090, SamplingParams(max_new_tokens=10))
