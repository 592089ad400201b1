"""The served speculative path runs P16: `k3compile build --verify-graphs` with the default pipeline puts one
`k3::kda_verify_inputs` per KDA layer into the engine's verify graph (and records it in the pass report and
the kernel-plugin manifest), and an LLMEngine over that engine directory verifies with exactly that graph;
greedy output stays the non-speculative output (k3-tiny, fp32, CPU: the op runs the reference there)."""
import random

import pytest
import torch

from k3compile.engine.build import BuildOptions, build_engine
from k3compile.model_def.loader import load_model
from k3compile.passes.pipeline import PipelineConfig
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams
from k3compile.runtime.spec.controlled import ControlledAcceptanceProposer
from tests.runtime.engine_helpers import assert_greedy_equal_up_to_ties, reference_generate, tokens

MODEL = "k3-tiny"
OP = "k3.kda_verify_inputs.default"


@pytest.fixture(scope="module")
def verify_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "verify"
    build_engine(BuildOptions(MODEL, dtype=torch.float32, pipeline=PipelineConfig.default(), verify_graphs=True),
                 str(out), log=lambda msg: None)
    return str(out)


def test_served_verify_graph_carries_p16(verify_engine):
    model = load_model(MODEL, dtype=torch.float32)
    n_kda = len(model.config.kda_layers)
    llm = LLMEngine(EngineArgs(model=None, engine_dir=verify_engine, dtype="fp32", page_size=16, chunk_size=32,
                               memory_bytes=1 << 22),
                    proposer=ControlledAcceptanceProposer({}, p=0.0, vocab_size=model.config.vocab_size, gamma=3))
    try:
        manifest = llm.provider.manifest
        verify = next(r for r in manifest["passes"]["verify"]["passes"] if r["name"] == "p16_kda_verify_inputs")
        assert verify["matches"] == n_kda
        assert all(next(r for r in manifest["passes"][m]["passes"] if r["name"] == "p16_kda_verify_inputs")
                   ["matches"] == 0 for m in ("decode", "prefill"))
        plugin = next(p for p in manifest["kernel_plugins"] if p["op"] == OP)
        assert plugin["count"] == {"verify": n_kda}
        assert plugin["module"] == "k3compile.passes.kernels.kda_verify_inputs"
        served = llm.runner.executor._verify_fn
        assert served is llm.provider.graphs["verify"]  # the executor verifies with the engine's graph itself
        assert sum(str(n.target) == OP for n in served.graph.nodes) == n_kda
    finally:
        llm.close()


def test_served_speculation_is_lossless_with_p16(verify_engine):
    model = load_model(MODEL, dtype=torch.float32)
    rng = random.Random(5)
    prompts = [tokens(rng, 9), tokens(rng, 4)]
    refs = [reference_generate(model, p, 10) for p in prompts]
    oracle = ControlledAcceptanceProposer({tuple(p): r for p, r in zip(prompts, refs)}, p=0.8,
                                          vocab_size=model.config.vocab_size, gamma=3)
    llm = LLMEngine(EngineArgs(model=None, engine_dir=verify_engine, dtype="fp32", page_size=16, chunk_size=32,
                               memory_bytes=1 << 22),
                    proposer=oracle)
    try:
        got = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
        assert_greedy_equal_up_to_ties(model, prompts, got, refs, 1e-4)
        assert llm.spec.stats.accepted > 0  # verify steps (through the graph with P16) really committed drafts
    finally:
        llm.close()
