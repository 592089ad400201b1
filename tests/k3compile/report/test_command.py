"""`k3compile report`: text and JSON agree; a real CPU torch.profiler trace is reported by CPU ops."""
import argparse
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from k3compile.commands import report as report_command
from k3compile.report import TraceError, analyze, load_trace
from tests.k3compile.report.synthetic_traces import two_step_decode


def run(argv):
    parser = argparse.ArgumentParser(prog="k3compile")
    report_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", *argv])
    return args.func(args)


def test_text_and_json_report(tmp_path, capsys):
    trace = two_step_decode(step_annotations=True).write(tmp_path / "t.json.gz", gz=True)
    out_json = tmp_path / "report.json"
    assert run([str(trace), "--json", str(out_json), "--top", "4"]) == 0
    text = capsys.readouterr().out
    assert "steps: 2, from annotations matching '^(decode_step|k3\\.step)'" in text
    assert "GPU events launched outside every step (not counted below): 2" in text
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "k3compile.report/1" and doc["time_unit"] == "us"
    assert doc["step_source"] == "annotations" and doc["outside_steps"] == 2
    steps = doc["steps"]
    assert [s["kernels"] for s in steps] == [8, 3]
    assert steps[0]["by_category"]["MoE"] == {"count": 2, "time_us": 12.0}
    assert [(g["stream"], g["count"], g["total_us"]) for g in steps[0]["gaps"]] == [(7, 6, 32.0), (13, 0, 0.0)]
    assert [k["name"] for k in doc["top_kernels"]] == [
        "k3_kda_decode_kernel", "flash_fwd_splitkv_mla_kernel",
        "ampere_bf16_s16816gemm_bf16_64x64_ldg8_f2f_tn", "sm90_xmma_gemm_bf16bf16_bf16f32"]
    # the text shows the same numbers: step 1's rows in the count, time and gap tables
    count_row, time_row, gap_row = [line.split()[1:] for line in text.splitlines()
                                    if line.startswith("decode_step_1")]
    assert count_row == ["1", "1", "1", "2", "2", "1", "1", "0", "8", "3", "7", "1"]
    assert time_row == ["10.00", "8.00", "14.00", "12.00", "7.00", "1.00", "5.00", "0.00", "57.00"]
    assert gap_row == ["75.00", "45.00", "60.0%", "6", "32.00", "21.00"]
    # the launching-op table: JSON rows and text rows agree
    assert [r["op"] for r in doc["launching_ops"]][:2] == ["(launched outside any op)", "(CUDA graph replay)"]
    graph_row = next(line for line in text.splitlines() if line.startswith("(CUDA graph replay)"))
    assert graph_row.split()[3:] == ["1.50", "0", "7.00", "18.2%"]


def test_bad_input_raises_a_one_line_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="x.json: not a chrome trace"):
        run([str(bad)])
    with pytest.raises(FileNotFoundError, match="missing.json"):
        run([str(tmp_path / "missing.json")])


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(["t.json", "--step-regex", "("])
    assert "not a valid regular expression" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["t.json", "--top", "0"])


def _profile_tiny_model(on_trace_ready):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 16))
    x = torch.randn(2, 16)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU],
                                  schedule=schedule(wait=0, warmup=1, active=3),
                                  on_trace_ready=on_trace_ready) as prof:
        for i in range(4):
            with record_function(f"decode_step_{i}"):
                torch.topk(model(x), 2)
            prof.step()


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_real_cpu_trace_reports_cpu_ops_per_step(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    _profile_tiny_model(lambda p: p.export_chrome_trace(str(path)))
    report = analyze(load_trace(path))
    assert not report.has_gpu_events and report.outside_steps == 0
    assert report.step_source == "annotations"
    assert [s.name for s in report.steps] == ["decode_step_1", "decode_step_2", "decode_step_3"]
    for s in report.steps:
        assert s.kernels == 0 and s.busy_fraction is None
        ops = {c: st.count for c, st in s.cpu_ops_by_category.items() if st.count}
        # two aten::linear, aten::layer_norm + aten::gelu, aten::topk
        assert ops == {"GEMM": 2, "norm/elementwise": 2, "MoE": 1}
    assert {op.name for op in report.top_cpu_ops} == {"aten::linear", "aten::layer_norm", "aten::gelu", "aten::topk"}

    assert run([str(path)]) == 0
    text = capsys.readouterr().out
    assert "No GPU kernels in this trace" in text
    assert "Top-level CPU ops per step by category" in text and "aten::linear" in text


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_real_cpu_trace_from_tensorboard_handler_gzipped(tmp_path, capsys):
    _profile_tiny_model(tensorboard_trace_handler(str(tmp_path / "tb"), use_gzip=True))
    (path,) = (tmp_path / "tb").glob("*.pt.trace.json.gz")
    assert run([str(path), "--step-regex", "^ProfilerStep#"]) == 0
    text = capsys.readouterr().out
    assert "steps: 3, from annotations matching '^ProfilerStep#'" in text
