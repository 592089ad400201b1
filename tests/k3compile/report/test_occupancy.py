"""Launch shapes: resident blocks per SM by CUDA's occupancy rules (values checked against the H200 trace of
traces/h200_s13/call2, whose kernels' args the profiler recorded) and waves per distinct launch, in the report."""
import pytest

from k3compile.report.analysis import analyze
from k3compile.report.occupancy import DEFAULT_LIMITS, device_limits, launch_shapes, resident_blocks
from k3compile.report.render import render_text, to_json
from k3compile.report.trace import load_trace
from tests.k3compile.report.synthetic_traces import T0, TraceBuilder

H200 = dict(DEFAULT_LIMITS)


@pytest.mark.parametrize("threads,regs,smem,want", [
    (128, 255, 1024, (2, "registers")),       # 48B fused KDA: 8 warps of 256 x 32 registers fit 65536
    (128, 167, 512, (3, "registers")),        # P6's B': 168 x 32 = 5376 a warp, 12 warps
    (256, 40, 512, (6, "registers")),         # P6's kernel A (rows design)
    (384, 168, 225652, (1, "registers")),     # cuBLAS's lm_head: registers and shared memory both allow 1 (tie: name)
    (128, 32, 200000, (1, "shared memory")),
    (1024, 16, 0, (2, "threads")),
    (32, 16, 0, (32, "blocks")),
])
def test_resident_blocks(threads, regs, smem, want):
    assert resident_blocks(threads, regs, smem, H200) == want


def test_device_limits_from_the_trace_with_defaults():
    meta = {"deviceProperties": [{"id": 0, "numSms": 4, "regsPerMultiprocessor": "x"}, {"id": 1, "numSms": 8}]}
    assert device_limits(meta, 0)["numSms"] == 4 and device_limits(meta, 0)["regsPerMultiprocessor"] == 65536
    assert device_limits(meta, 1)["numSms"] == 8 and device_limits({}, 0) == H200


def _trace(tmp_path):
    b = TraceBuilder()
    b.device_properties = {"numSms": 4}
    b.annotation("decode_step#0", T0, 100)
    kda = {"grid": [4, 2, 1], "block": [128, 1, 1], "registers per thread": 255, "shared memory": 1024}
    gemv = {"grid": [40, 1, 1], "block": [128, 1, 1], "registers per thread": 72, "shared memory": 32}
    b.kernel_launch("cudaLaunchKernel", T0 + 1, "_fused_kda_decode_kernel", T0 + 10, 8, launch=kda)
    b.kernel_launch("cudaLaunchKernel", T0 + 2, "_gemv_rows_kernel", T0 + 20, 5, launch=gemv)
    b.kernel_launch("cudaLaunchKernel", T0 + 3, "_gemv_rows_kernel", T0 + 30, 7, launch=gemv)
    b.kernel_launch("cudaMemcpyAsync", T0 + 4, "Memcpy DtoD (Device -> Device)", T0 + 40, 1, cat="gpu_memcpy")
    return load_trace(b.write(tmp_path / "t.json"))


def test_launch_shapes_group_by_shape_and_rank_by_time(tmp_path):
    trace = _trace(tmp_path)
    shapes = launch_shapes(trace.gpu_events, trace.metadata)
    assert [(s.name, s.launches) for s in shapes] == [("_gemv_rows_kernel", 2), ("_fused_kda_decode_kernel", 1)]
    gemv, kda = shapes
    assert (gemv.blocks, gemv.resident_per_sm, gemv.waves, gemv.mean_us) == (40, 7, round(40 / 28, 3), 6.0)
    assert (kda.blocks, kda.resident_per_sm, kda.limited_by, kda.waves) == (8, 2, "registers", 1.0)


def test_the_report_shows_and_serializes_them(tmp_path):
    report = analyze(load_trace(_trace(tmp_path).path))
    assert [s.name for s in report.launch_shapes] == ["_gemv_rows_kernel", "_fused_kda_decode_kernel"]
    text = render_text(report)
    assert "Launch shapes by GPU time" in text and "1.43" in text
    assert to_json(report)["launch_shapes"][1]["waves"] == 1.0
