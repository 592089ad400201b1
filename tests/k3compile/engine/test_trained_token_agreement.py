"""Issue 9's accuracy gate on a trained model: the engine `build` emits (every pass of the default pipeline) and the
model it was built from (eager model_def, no passes) generate the same greedy tokens from the trained k3-tiny target
of checkpoints/spec-tiny (validation loss 2.1 nats/byte: its argmax margins are real, unlike random weights'). On
CPU the passes' ops run their reference implementations, so the first test checks the graph rewrites on a trained
model; the kernels' own numerics are checked against the same references on the GPU (tests/passes/kernels). The GPU
test runs the same comparison with the kernels: a bf16 engine on CUDA (CUDA graphs, PDL) against the bf16 eager
model, both scored against the fp32 eager model's tokens (bf16 rounding alone may flip a near tie, so the engine must
stay as close to fp32 as the unfused bf16 model does)."""
import os

import pytest
import torch

from k3compile.engine.build import BuildOptions, build_engine
from k3compile.passes.pipeline import PipelineConfig
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "..", "checkpoints", "spec-tiny", "target")
PROMPTS = ("import os\nimport sys\n\n\ndef main(", "class Queue:\n    def __init__(self, maxsize=0):\n        self.",
           "    for i in range(len(items)):\n        if ", "def _check(value):\n    \"\"\"Return True if ")
NEW = 24


needs_target = pytest.mark.skipif(not os.path.isdir(TARGET), reason="checkpoints/spec-tiny not in this checkout")


def _generate(args: EngineArgs) -> list[list[int]]:
    llm = LLMEngine(args)
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
        return llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], greedy)
    finally:
        llm.close()


@needs_target
def test_every_pass_keeps_the_trained_models_greedy_tokens(tmp_path):
    path = str(tmp_path / "engine")
    build_engine(BuildOptions(TARGET, dtype=torch.float32, pipeline=PipelineConfig.default()), path,
                 log=lambda msg: None)
    common = dict(dtype="fp32", memory_bytes=64 << 20, enable_prefix_cache=False)
    engine = _generate(EngineArgs(model=None, engine_dir=path, **common))
    model = _generate(EngineArgs(model=TARGET, **common))
    assert all(len(t) == NEW for t in engine + model)
    assert engine == model


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens generated before the first one that differs from the reference's, summed over the prompts."""
    total = 0
    for got, want in zip(tokens, reference):
        total += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return total


def test_agreement_counts_the_common_prefix():
    assert _agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == 5
    assert _agreement([[7, 2]], [[1, 2]]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_target
def test_cuda_engine_keeps_the_trained_models_greedy_tokens(tmp_path):
    path = str(tmp_path / "engine")
    build_engine(BuildOptions(TARGET, dtype=torch.bfloat16, device="cuda", pipeline=PipelineConfig.default()),
                 path, log=lambda msg: None)
    common = dict(device="cuda", memory_bytes=256 << 20, enable_prefix_cache=False)
    reference = _generate(EngineArgs(model=TARGET, dtype="fp32", cuda_graphs=False, **common))
    eager = _generate(EngineArgs(model=TARGET, dtype="bf16", cuda_graphs=False, **common))
    engine = _generate(EngineArgs(model=None, engine_dir=path, dtype="bf16", **common))
    total = NEW * len(PROMPTS)
    got, base = _agreement(engine, reference), _agreement(eager, reference)
    print(f"greedy tokens agreeing with fp32 eager before the first difference: engine {got}/{total}, "
          f"bf16 eager {base}/{total}")
    # one prompt's worth of slack for a near tie that bf16 rounding flips one way in the kernels and not in ATen
    assert got >= min(base, total) - NEW, (got, base)
    assert got >= total * 3 // 4, (got, base)
