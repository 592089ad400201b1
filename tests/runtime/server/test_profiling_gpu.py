"""On CUDA: a server-side profile (the engine's step wrapped by ServerProfiler) of an engine replaying decode
CUDA graphs starts with the padding-row attribution run, and the report attributes the replays to nodes."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_server_profile_attributes_graph_replays(tmp_path):
    from k3compile.engine.build import compile_graphs
    from k3compile.engine.engine import Engine
    from k3compile.model_def.loader import load_model
    from k3compile.passes.pipeline import PipelineConfig
    from k3compile.report import analyze, load_trace
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.sampling import SamplingParams
    from k3compile.runtime.server.profiling import ServerProfiler

    from k3compile.bench.timing import init_profiler_for_cuda_graphs
    init_profiler_for_cuda_graphs()
    model = load_model("k3-tiny", device="cuda")
    graphs, _ = compile_graphs(model, PipelineConfig.default())
    # fixed pools: the GPU suite runs files side by side, so a fraction of the device may not be free
    llm = LLMEngine(EngineArgs(device="cuda", cuda_graph_buckets=(1, 2), memory_bytes=256 << 20),
                    model=Engine(model.config, graphs, torch.float32))
    assert llm.runner.executor.cuda_graphs
    profiler = ServerProfiler(llm)
    profiler.start(4, str(tmp_path), (1,))
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=8))
    assert profiler.done.wait(5)
    report = analyze(load_trace(profiler.last_trace))
    assert [s.name for s in report.steps] == [f"k3.step#{i}" for i in range(4)]
    assert [r["label"] for r in report.attribution_runs] == ["decode bs=1 (padding rows)"]
    decode = [s for s in report.steps if s.graph_launches == 1]
    assert decode, "no decode step replayed a CUDA graph"
    rl = report.roofline
    print(f"attributed {rl.attributed_us} us/step, unattributed {rl.unattributed_us} ({rl.unattributed_reasons})")
    replayed = sum(s.gpu_time_us for s in decode) / len(report.steps)
    assert rl.attributed_us >= 0.9 * replayed
