"""The served path runs the graph the ladder's last rung measures: `k3compile build` with no pass flags runs the
default pipeline (every registered pass), and `serve ENGINE` / `generate --engine` (LLMEngine over the engine
directory, unified memory and prefix cache on) execute that engine's decode graph, op for op the graph
`bench ladder` times as its last rung."""
import argparse

import torch

from k3compile.bench import ladder
from k3compile.capture import STEP_INPUTS
from k3compile.commands import build as build_cmd
from k3compile.model_def.loader import load_model
from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.verify import randomized_inputs, rel_err, run_graph, step_inputs
from k3compile.runtime.engine import EngineArgs, LLMEngine

MODEL = "kimi-linear-tiny"


def _ops(gm) -> list:
    """The graph as a sequence of (op, target, non-tensor args): what runs, independent of node names."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.append((str(n.target), tuple(a for a in n.args if isinstance(a, (int, float, str, bool)))))
        elif n.op in ("placeholder", "output"):
            out.append((n.op,))
    return out


def test_build_without_pass_flags_runs_the_default_pipeline():
    sub = argparse.ArgumentParser().add_subparsers()
    args = build_cmd.register(sub).parse_args(["--model", MODEL, "-o", "x"])
    pipeline = build_cmd.pipeline_from_args(args)
    assert pipeline.to_dict() == PipelineConfig.default().to_dict()
    assert pipeline.enabled_passes() == PipelineConfig.default().enabled_passes()


def test_served_engine_executes_the_ladders_last_rung(built_engine):
    _, path = built_engine(MODEL)  # fp32, CPU, PipelineConfig.default() (what `build` runs, test above)
    llm = LLMEngine(EngineArgs(model=None, engine_dir=path, dtype="fp32", enable_unified_memory=True,
                               enable_prefix_cache=True))
    try:
        served = llm.runner.executor._decode
        assert served is llm.provider.graphs["decode"]  # the executor calls the engine's graph itself
        sub = argparse.ArgumentParser().add_subparsers()
        bench = ladder.LadderBench(ladder.register(sub).parse_args(["--model", MODEL, "--dtype", "fp32"]), [1],
                                   torch.device("cpu"))
        bench.model, bench.log = load_model(MODEL, dtype=torch.float32, seed=0), (lambda msg: None)
        last = bench.final_graph()
        built = PipelineConfig.from_dict(llm.provider.manifest["build"]["pipeline"])  # its order lists disabled passes
        assert bench.rungs[-1]["passes"] == built.enabled_passes()
        assert _ops(served) == _ops(last)
        inputs = randomized_inputs(step_inputs(bench.model, "decode"), 0)
        (a, a_pools), (b, b_pools) = run_graph(served, inputs), run_graph(last, inputs)
        for x, y in zip(a + a_pools, b + b_pools):
            if isinstance(y, torch.Tensor):
                assert rel_err(x, y) <= 1e-6
        assert len(STEP_INPUTS) == sum(n.op == "placeholder" for n in served.graph.nodes)
        # and it serves: greedy tokens through the scheduler, prefix cache and unified arena
        ids = llm.generate([[1, 2, 3, 4, 5]], _greedy(4))
        assert len(ids[0]) == 4
    finally:
        llm.close()


def _greedy(n):
    from k3compile.runtime.sampling import SamplingParams
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
