"""On CUDA: an engine step replayed from a CUDA graph is attributed node by node, with peaks measured in
the same run (tools/profile_engine_step.py end to end on k3-tiny)."""
import importlib.util
import os

import pytest
import torch

from k3compile.report import analyze, load_trace
from k3compile.report.roofline import MEASURED

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "profile_engine_step.py")


def test_graph_replay_kernels_are_attributed(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_engine_step", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = str(tmp_path / "tiny.json.gz")
    assert tool.main(["--model", "k3-tiny", "--dtype", "bf16", "--batch", "2", "--context", "64",
                      "--steps", "2", "--out", path]) == 0
    report = analyze(load_trace(path))
    assert [s.graph_launches for s in report.steps] == [1, 1]
    rl = report.roofline
    replayed_us = sum(s.gpu_time_us for s in report.steps) / len(report.steps)
    print(f"attributed {rl.attributed_us} us/step, unattributed {rl.unattributed_us} ({rl.unattributed_reasons})")
    assert rl.attributed_us >= 0.9 * replayed_us
    assert rl.peaks.source == MEASURED and rl.peaks.bytes_per_s > 1e12 and rl.peaks.flops_per_s > 1e14
    assert {r.layer for r in rl.layers} >= {f"L{i}" for i in range(9)} | {"embed", "head"}
    assert report.critical_paths and report.critical_path_mean["total"] > 0
