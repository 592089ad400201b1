"""Every row of the OpenAI surface again, condensed, on the other ways `serve` runs: unified memory
with the overlap scheduler, and a compiled engine (k3-tiny, fp32, default passes) on unified
memory. Prompt logprobs are checked against the CPU reference model."""
import json
import re

import pytest

from .conftest import MODEL, start_server


@pytest.fixture(scope="module", params=["unified-overlap", "engine-unified"])
def variant(request, built_engine):
    if request.param == "unified-overlap":
        s = start_server(enable_unified_memory=True, overlap=True)
    else:
        _, engine_dir = built_engine(MODEL)  # the engine tests' build (tests/conftest.py), read only here
        s = start_server(model=None, engine_dir=engine_dir, enable_unified_memory=True)
    yield s
    s.stop()


def test_every_row_works(variant, ref_logits):
    client = variant.client()
    tok = variant.tokenizer
    # echo + logprobs + max_tokens=0 over a prompt list, equal to the reference
    prompts = ["Paris is in France", "one two three"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    for c, p in zip(r.choices, prompts):
        ids = tok.encode(p)
        ref = ref_logits(ids).double().log_softmax(-1)
        assert c.logprobs.token_logprobs[1:] == pytest.approx([float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                                              abs=2e-3)
    # n > 1 (forked) and best_of, with logprobs; greedy forks agree
    r = client.completions.create(model=MODEL, prompt="abc", n=3, max_tokens=5, temperature=0, logprobs=1,
                                  extra_body={"return_token_ids": True})
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) == 1
    assert variant.wait_idle()["forked_requests"] >= 2
    r = client.completions.create(model=MODEL, prompt="abc", n=2, best_of=3, max_tokens=4, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1]
    # penalties and logit bias
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, logit_bias={"66": 100},
                                  presence_penalty=1.0, frequency_penalty=0.5, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [66, 66, 66]
    # chat logprobs, streamed n = 2
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2,
                                                 max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    assert {c.index for ch in chunks for c in ch.choices} == {0, 1}
    # structured output
    r = client.completions.create(model=MODEL, prompt="id: ", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "j"}], max_tokens=40,
                                       temperature=0.5, seed=3,
                                       response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert set(json.loads(r.choices[0].message.content)) == {"a"}
    # tokenize round trip
    import httpx
    from .conftest import API_KEY
    t = httpx.post(f"{variant.base_url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "hi"}).json()
    assert t["tokens"] == tok.encode("hi")
    variant.wait_idle()
