"""Prompt/output length sets for `bench serve`.

* `sharegpt-synth`: a ShareGPT-like set that ships with the project (data/sharegpt_synth.json). It
  is synthetic, not ShareGPT itself: lengths drawn by `synthesize()` from log-normal distributions
  shaped like chat traffic (short-to-medium prompts with a long tail, answers of a few hundred
  tokens), seeded, so anyone can regenerate the file bit-for-bit:
      python -m k3compile.bench.serve_dataset > k3compile/bench/data/sharegpt_synth.json
* `fixed`: every request has --input-len prompt tokens and --output-len output tokens (vLLM's
  `random` dataset with range ratio 0).

Prompts are random token ids (the completions API takes a list of ids, as vLLM and SGLang do), so
prompt lengths are exact for any tokenizer; `--prompt-kind words` sends text instead (common
words, about one token each in BPE vocabularies) for endpoints that take only text.
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

DATA = os.path.join(os.path.dirname(__file__), "data", "sharegpt_synth.json")
SEED = 20240601
SIZE = 1000
# log-normal (median, sigma) and clip range, in tokens
PROMPT = (110.0, 1.1, 4, 1024)
OUTPUT = (140.0, 0.9, 4, 1024)
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or "
         "one had by word but not what all were we when your can said there use an each which she do how "
         "their if will up other about out many then them these so some her would make like him into time "
         "has look two more write go see number no way could people my than first water been call who oil "
         "its now find long down day did get come made may part").split()


def synthesize(n: int = SIZE, seed: int = SEED) -> list[tuple[int, int]]:
    rng = random.Random(seed)

    def draw(median, sigma, lo, hi):
        return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))

    return [(draw(*PROMPT), draw(*OUTPUT)) for _ in range(n)]


def load_shipped() -> list[tuple[int, int]]:
    with open(DATA) as f:
        doc = json.load(f)
    return [tuple(p) for p in doc["pairs"]]


@dataclass
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def make_requests(dataset: str, n: int, seed: int, input_len: int = 128, output_len: int = 128,
                  prompt_kind: str = "ids", id_range: tuple[int, int] = (10, 250)) -> list[BenchRequest]:
    if n < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {n}")
    if dataset == "fixed":
        pairs = [(input_len, output_len)] * n
    elif dataset == "sharegpt-synth":
        shipped = load_shipped()
        order = random.Random(seed).sample(range(len(shipped)), min(n, len(shipped)))
        pairs = [shipped[i] for i in order] + [shipped[i % len(shipped)] for i in range(n - len(order))]
    else:
        raise ValueError(f"unknown dataset {dataset!r}: sharegpt-synth or fixed")
    if prompt_kind not in ("ids", "words"):
        raise ValueError(f"prompt kind must be ids or words, got {prompt_kind!r}")
    lo, hi = id_range
    if not 0 <= lo < hi:
        raise ValueError(f"bad token id range {id_range}")
    rng = random.Random(seed + 1)
    out = []
    for p, o in pairs:
        if prompt_kind == "ids":
            prompt = [rng.randrange(lo, hi) for _ in range(p)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(p))
        out.append(BenchRequest(prompt, p, o))
    return out


if __name__ == "__main__":
    pairs = synthesize()
    print(json.dumps({"name": "sharegpt-synth", "generator": "k3compile.bench.serve_dataset.synthesize",
                      "seed": SEED, "prompt_lognormal": PROMPT, "output_lognormal": OUTPUT,
                      "pairs": pairs}, separators=(",", ":")))
