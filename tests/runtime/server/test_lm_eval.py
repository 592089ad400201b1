"""lm-evaluation-harness as a client: its `local-completions` model runs a loglikelihood (multiple
choice) task and a generate-until task against `serve`, offline (tasks and data are local files;
the tokenizer is the server's own, through /tokenizer_info + /tokenize). Every loglikelihood it
gets must equal the CPU reference model's (lm_eval sends echo + logprobs=1 + max_tokens=1 with
token-id prompt lists and reads the prompt part)."""
import json

import pytest

from .conftest import API_KEY, MODEL

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " banana", " 42"], "answer": 0},
    {"question": "One, two,", "choices": [" three", " zebra"], "answer": 0},
    {"question": "def fib(n):", "choices": [" return", " purple"], "answer": 1},
]
GEN_DOCS = [{"question": "Say A:", "answer": "A"}, {"question": "k3compile", "answer": "x"}]


def write_tasks(tmp_path) -> str:
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (tmp_path / "k3_mc.yaml").write_text(f"""task: k3_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp_path / "k3_gen.yaml").write_text(f"""task: k3_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
""")
    return str(tmp_path)


def test_lm_eval_local_completions_against_serve(server, ref_logits, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # only this test's two tasks: indexing lm_eval's thousands of bundled task YAMLs took most of the test's time
    tasks = TaskManager(include_path=write_tasks(tmp_path), include_defaults=False)
    before = server.front.metrics()
    out = simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{server.base_url}/v1/completions", "auth_token": API_KEY,
                    "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True, "max_length": 512},
        tasks=["k3_mc", "k3_gen"], task_manager=tasks, limit=None,
        log_samples=True)
    res = out["results"]
    # every loglikelihood lm_eval got is the CPU reference model's, for the exact (context, continuation)
    # it sent; so its accuracy is the reference's
    tok = server.tokenizer
    samples = out["samples"]["k3_mc"]
    assert len(samples) == len(DOCS)
    correct = 0
    for s in samples:
        lls = []
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            c_ids, t_ids = tok.encode(ctx, add_bos=False), tok.encode(cont, add_bos=False)
            lp = ref_logits(c_ids + t_ids).double().log_softmax(-1)
            want = sum(float(lp[len(c_ids) - 1 + i, t]) for i, t in enumerate(t_ids))
            assert resp[0][0] == pytest.approx(want, abs=1e-3)
            lls.append(want)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == s["doc"]["answer"])
    assert res["k3_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))
    gens = [s["resps"][0][0] for s in out["samples"]["k3_gen"]]
    assert len(gens) == len(GEN_DOCS) and all(isinstance(g, str) for g in gens)
    assert "exact_match,none" in res["k3_gen"]
    m = server.wait_idle()
    assert m["generated_tokens"] > before["generated_tokens"]
