"""DSpark end to end in the engine on the trained tiny pair (checkpoints/spec-tiny): the prefill and
verify steps hand the target's features of committed positions to the drafter; greedy output equals
plain greedy decoding token for token and the drafter's blocks are really accepted (mean committed
tokens per verify > 1). A compiled engine (graphs that return logits only) is refused with a clear error."""
import os

import pytest
import torch

from k3compile.model_def.loader import load_model
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.executor import Executor, emits_features
from k3compile.runtime.sampling import SamplingParams
from k3compile.runtime.spec.dspark_proposer import DSparkProposer
from tests.runtime.engine_helpers import assert_greedy_equal_up_to_ties, check_idle, reference_generate

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "checkpoints", "spec-tiny")
TARGET, DRAFTER = os.path.join(ROOT, "target"), os.path.join(ROOT, "drafter")
TIE = 1e-4
NEW = 24
TEXTS = [b"    def __init__(self, name, value=None):\n        self.name = name\n",
         b"import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n",
         b"        if not isinstance(key, str):\n            raise TypeError("]


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, progress=False)


@pytest.fixture(scope="module")
def workload(target):
    prompts = [list(t) for t in TEXTS]  # the target is byte-level: ids 0..255 are the bytes
    return prompts, [reference_generate(target, p, NEW) for p in prompts]


class Recording(DSparkProposer):
    """Checks the runtime's side of the feature contract: rows in position order, each computed position once,
    never the anchor's before the target read it."""
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: dict[str, list[tuple[int, int, int]]] = {}

    def observe(self, rid, token_ids, features, start=None):
        self.log.setdefault(rid, []).append((start, features.shape[0], len(token_ids)))
        super().observe(rid, token_ids, features, start)


@pytest.mark.parametrize("cfg", [dict(page_size=16, chunk_size=32, spec_window="replay"),
                                 dict(page_size=4, chunk_size=16, overlap=True, spec_window="snapshot")],
                         ids=["replay", "snapshot,overlap,chunked"])
def test_dspark_greedy_equals_plain_decoding(target, workload, cfg):
    prompts, refs = workload
    proposer = Recording.from_checkpoint(DRAFTER, target, gamma=4)
    engine = LLMEngine(EngineArgs(memory_bytes=1 << 22, **cfg), model=target, proposer=proposer)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert_greedy_equal_up_to_ties(target, prompts, got, refs, TIE)
    s = engine.spec.stats
    assert s.accept_length > 1.2, s  # the trained pair: about 1.8 tokens per verify at gamma 4
    for rid, log in proposer.log.items():
        nxt = 0
        for start, n, committed in log:
            assert start == nxt, (rid, log)  # contiguous, from position 0 (no prefix cache hit here)
            nxt = start + n
            assert nxt <= committed - 1, (rid, log)  # the newest committed token (the anchor) has none yet
    assert not proposer._rows, "finished requests were released"
    check_idle(engine)


def test_prefix_hit_gives_features_from_the_first_computed_position(target, workload):
    prompts, refs = workload
    proposer = Recording.from_checkpoint(DRAFTER, target, gamma=4)
    engine = LLMEngine(EngineArgs(memory_bytes=1 << 22, page_size=16, chunk_size=32), model=target, proposer=proposer)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine.generate([prompts[0]], params)
    again = engine.generate([prompts[0] + refs[0][:4]], params)  # reuses the cached prompt
    assert engine.scheduler.cache_hit_tokens > 0
    second = [log for rid, log in proposer.log.items()][-1]
    assert second[0][0] == engine.scheduler.cache_hit_tokens > 0
    full = reference_generate(target, prompts[0] + refs[0][:4], NEW)
    assert_greedy_equal_up_to_ties(target, [prompts[0] + refs[0][:4]], again, [full], TIE)
    check_idle(engine)


def test_providers_without_features_are_refused(target):
    assert emits_features(target)
    graphs = {"prefill": target.step_tensors, "decode": target.step_tensors, "verify": target.step_tensors}
    assert not emits_features(graphs)
    from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
    from k3compile.model_def.cache import CacheTensors
    cache = CacheTensors.allocate(target.cache_spec(), 2, 4, 16)
    ex = Executor(graphs, cache)
    window = DraftWindow.allocate(DraftWindowSpec(target.cache_spec(), 5, "replay"), 1, "cpu")
    with pytest.raises(ValueError, match="does not emit them"):
        ex.prepare_verify(window, 5, (1, 4, 8))


def test_generate_cli_dspark_equals_plain(capsys):
    from k3compile.cli import main
    prompt = TEXTS[1].decode()
    base = ["generate", "--model", TARGET, "--prompt", prompt, "--max-new-tokens", "20"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--speculative", "dspark", "--draft", DRAFTER, "--num-speculative-tokens", "4"]) == 0
    assert capsys.readouterr().out == plain
