"""The served path runs the graph the ladder's last rung measures: `k3compile build` with no pass flags runs the
default pipeline (every registered pass), and `serve ENGINE --enable-unified-memory` (the serve command's own
flags -> EngineArgs -> LLMEngine, prefix cache on) and `generate --engine` execute that engine's decode graph, op
for op the graph `bench ladder` times as its last rung, replayed per decode bucket the engine recorded (the
ladder's executor captures the bucket of its batch size). Both families: Kimi Linear and K3 (the device's
served-path check builds k3-mini-6b)."""
import argparse

import pytest
import torch

from k3compile import cli
from k3compile.bench import ladder
from k3compile.capture import STEP_INPUTS
from k3compile.commands import build as build_cmd
from k3compile.commands import serve as serve_cmd
from k3compile.model_def.loader import load_model
from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.verify import randomized_inputs, rel_err, run_graph, step_inputs
from k3compile.runtime.engine import LLMEngine

MODELS = ("kimi-linear-tiny", "k3-tiny")
PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"  # > 2 KV pages of bytes


def _ops(gm) -> list:
    """The graph as a sequence of (op, target, non-tensor args): what runs, independent of node names."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.append((str(n.target), tuple(a for a in n.args if isinstance(a, (int, float, str, bool)))))
        elif n.op in ("placeholder", "output"):
            out.append((n.op,))
    return out


def _parser(register):
    return register(argparse.ArgumentParser().add_subparsers())


def test_build_without_pass_flags_runs_the_default_pipeline():
    args = _parser(build_cmd.register).parse_args(["--model", MODELS[0], "-o", "x"])
    pipeline = build_cmd.pipeline_from_args(args)
    assert pipeline.to_dict() == PipelineConfig.default().to_dict()
    assert pipeline.enabled_passes() == PipelineConfig.default().enabled_passes()
    # the ladder, without pass flags, climbs the same pipeline
    bench_args = _parser(ladder.register).parse_args(["--model", MODELS[0]])
    assert build_cmd.pipeline_from_args(bench_args).to_dict() == pipeline.to_dict()


@pytest.mark.parametrize("model", MODELS)
def test_served_engine_executes_the_ladders_last_rung(built_engine, model, monkeypatch, capsys):
    _, path = built_engine(model)  # fp32, CPU, PipelineConfig.default() (what `build` runs, test above)
    served_args = serve_cmd.engine_args(_parser(serve_cmd.register).parse_args(
        [path, "--enable-unified-memory", "--memory-bytes", str(64 << 20)]))
    assert served_args.engine_dir == path and served_args.enable_prefix_cache and served_args.enable_unified_memory
    llm = LLMEngine(served_args)  # what `serve` constructs (commands/serve.py: LLMEngine(engine_args(args)))
    try:
        ex = llm.runner.executor
        served = ex._decode
        assert served is llm.provider.graphs["decode"]  # the executor calls the engine's graph itself
        # every decode bucket the engine recorded gets its graph, so a batch of b replays a graph of b rows when b
        # is a bucket (the ladder's executor at batch b captures exactly that one)
        assert ex.buckets == tuple(llm.provider.manifest["decode_buckets"])
        bench = ladder.LadderBench(_parser(ladder.register).parse_args(["--model", model, "--dtype", "fp32"]), [1],
                                   torch.device("cpu"))
        bench.model, bench.log = load_model(model, dtype=torch.float32, seed=0), (lambda msg: None)
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
        # it serves (scheduler, prefix cache, unified arena), and `generate --engine` gives the same greedy tokens
        prompt = llm.tokenizer.encode(PROMPT)
        want = llm.generate([prompt], _greedy(8))[0]
        assert len(want) == 8
        assert llm.generate([prompt], _greedy(8))[0] == want   # again, now from the prefix cache
        assert llm.metrics()["cache_hit_tokens"] > 0
    finally:
        llm.close()
    monkeypatch.setattr(cli, "COMMANDS", list(cli.COMMANDS))
    assert cli.main(["generate", "--engine", path, "--prompt", PROMPT, "--max-new-tokens", "8", "--show-ids"]) == 0
    got = [int(t) for t in capsys.readouterr().out.rsplit("ids:", 1)[1].split()]
    assert got and got == want[:len(got)]   # generate stops at the tokenizer's eos; the served run ignored it


def _greedy(n):
    from k3compile.runtime.sampling import SamplingParams
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
