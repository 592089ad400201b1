"""Attribution of CUDA-graph replays to nodes, roofline with same-run peaks, critical path, fusions,
--diff and --html, on a synthetic engine trace whose every number is known (synthetic_traces.py)."""
import json
import shutil
import struct
import subprocess
import zlib

import pytest

from k3compile.report import analyze, load_trace
from k3compile.report.attribution import OUTSIDE, REPLAY, align, attribute
from k3compile.report.critical_path import COMPUTE_BOUND, COPIES, CPU_BOUND, LAUNCH_GAP, MEMORY_BOUND
from k3compile.report.diff import diff, render_diff
from k3compile.report.html import COLORS, render_html
from k3compile.report.roofline import MEASURED, UNATTRIBUTED
from k3compile.report.steps import segment
from tests.k3compile.report.synthetic_traces import attributed_graph_step, two_step_decode
from tests.k3compile.report.test_command import run


@pytest.fixture
def trace_path(tmp_path):
    return attributed_graph_step().write(tmp_path / "engine.json.gz", gz=True)


@pytest.mark.parametrize("decoy", [False, True])
def test_graph_replay_kernels_map_to_nodes(tmp_path, decoy):
    trace = load_trace(attributed_graph_step(decoy=decoy).write(tmp_path / "engine.json.gz", gz=True))
    seg = segment(trace)
    attr, refs = attribute(trace, seg)
    assert [(r.label, len(r.kernels)) for r in refs] == [("decode bs=1", 3)] + ([("decode bs=8", 2)] if decoy else [])
    got = {ev.name: (a.node.name if a.node else None, a.how, a.reason) for ev, a in attr.items()}
    assert got == {"sm90_xmma_gemm_bf16": ("mm_0", REPLAY, None), "elem_a": ("pow_1", REPLAY, None),
                   "elem_b": ("mean_1", REPLAY, None),
                   "Memcpy HtoD (Pageable -> Device)": (None, None, OUTSIDE)}
    gemm = next(a for ev, a in attr.items() if ev.name.startswith("sm90"))
    assert (gemm.node.layer, gemm.node.pass_, gemm.node.op) == ("L0", "p01_gemm_merge", "aten.mm.default")


def test_alignment_substitutions_insertions_deletions_and_repeated_layers():
    assert align(list("abc"), list("abc")) == {0: 0, 1: 1, 2: 2}
    assert align(list("abcd"), list("axcd")) == {0: 0, 1: 1, 2: 2, 3: 3}  # substitution: by position
    assert align(list("abcdef"), list("abXYcdef")) == {0: 0, 1: 1, 4: 2, 5: 3, 6: 4, 7: 5}  # inserted XY
    assert align(list("abcdef"), list("abef")) == {0: 0, 1: 1, 2: 4, 3: 5}  # c, d not replayed
    # a step repeats one layer's kernels: a kernel missing in layer 2 of 12 must not shift later layers
    layer = ["norm", "mm", "act", "mm2", "add", "conv", "kda", "mm3", "add2"]
    ref = layer * 12
    rep = ref[:9 + 4] + ref[9 + 5:]  # layer 1's "add" missing
    got = align(ref, rep)
    assert len(got) == len(rep) and all(ref[p] == rep[q] for q, p in got.items())
    assert got[len(rep) - 1] == len(ref) - 1


def test_roofline_layers_and_fusions(trace_path):
    rl = analyze(load_trace(trace_path)).roofline
    assert rl.peaks.source == MEASURED
    assert rl.peaks.bytes_per_s == pytest.approx(1e12) and rl.peaks.flops_per_s == pytest.approx(1e14)
    rows = {r.node: (r.time_us, r.floor_us, r.roofline, r.bound, r.achieved_gb_s) for r in rl.rows}
    assert rows == {"mm_0": (4.0, 4.0, 1.0, "compute", 500.0), "pow_1": (2.0, 1.0, 0.5, "memory", 500.0),
                    "mean_1": (3.0, 0.5, 0.1667, "memory", 166.667)}
    layers = {r.layer: (r.kernels, r.time_us, r.floor_us, r.roofline) for r in rl.layers}
    assert layers == {"L0": (3, 9.0, 5.5, 0.6111), UNATTRIBUTED: (1, 1.0, 0.0, None)}
    assert (rl.attributed_us, rl.unattributed_us, rl.unattributed_reasons) == (9.0, 1.0, {OUTSIDE: 1.0})
    (f,) = rl.fusions
    assert (f.ops, f.example_nodes, f.layers) == (["aten.pow.Tensor_Scalar", "aten.mean.dim"], ["pow_1", "mean_1"], ["L0"])
    assert (f.occurrences, f.time_us, f.floor_us, f.recoverable_us) == (1, 6.0, 1.5, 4.5)


def test_critical_path_through_graph_replay(trace_path):
    (cp,) = analyze(load_trace(trace_path)).critical_paths
    assert cp.total_us == 31.0
    assert cp.by_class == {COMPUTE_BOUND: 4.0, MEMORY_BOUND: 5.0, COPIES: 0.0, "communication": 0.0,
                           LAUNCH_GAP: 12.0, CPU_BOUND: 10.0}
    assert [(s.kind, s.start_us, s.dur_us, s.node) for s in cp.segments] == [
        (CPU_BOUND, 0.0, 10.0, None), (LAUNCH_GAP, 10.0, 10.0, None), (COMPUTE_BOUND, 20.0, 4.0, "mm_0"),
        (LAUNCH_GAP, 24.0, 1.0, None), (MEMORY_BOUND, 25.0, 2.0, "pow_1"), (LAUNCH_GAP, 27.0, 1.0, None),
        (MEMORY_BOUND, 28.0, 3.0, "mean_1")]


def test_critical_path_pdl_overlap_sync_and_second_stream(tmp_path):
    from tests.k3compile.report.synthetic_traces import T0, TraceBuilder
    b = TraceBuilder()
    t = lambda x: T0 + x  # noqa: E731
    b.annotation("decode_step#0", t(0), 100)
    b.kernel_launch("cudaLaunchKernel", t(1), "k_first", t(5), 10)           # 5-15
    b.runtime("cudaStreamSynchronize", t(3), 13)                              # returns at 16
    b.kernel_launch("cudaLaunchKernel", t(20), "k_pdl_a", t(22), 10)         # 22-32
    b.kernel_launch("cudaLaunchKernelExC", t(21), "k_pdl_b", t(30), 6)       # starts before k_pdl_a ends (PDL)
    b.kernel_launch("cudaLaunchKernel", t(22), "k_side", t(36), 4, stream=9)  # 36-40: waits for k_pdl_b
    b.kernel_launch("cudaLaunchKernel", t(23), "k_last", t(41), 2)           # waits for k_side (41-43)
    (cp,) = analyze(load_trace(b.write(tmp_path / "p.json"))).critical_paths
    assert (cp.pdl_overlaps, cp.cross_stream_waits, cp.total_us) == (1, 2, 43.0)
    assert [(s.kind, s.name, s.start_us, s.dur_us) for s in cp.segments] == [
        (CPU_BOUND, "cudaLaunchKernel", 0.0, 2.0), (LAUNCH_GAP, "kernel launch delay", 2.0, 3.0),
        (MEMORY_BOUND, "k_first", 5.0, 10.0), (CPU_BOUND, "cudaStreamSynchronize", 15.0, 1.0),
        (CPU_BOUND, "cudaLaunchKernel", 16.0, 5.0), (LAUNCH_GAP, "kernel launch delay", 21.0, 1.0),
        (MEMORY_BOUND, "k_pdl_a", 22.0, 10.0), (MEMORY_BOUND, "k_pdl_b", 32.0, 4.0),
        (MEMORY_BOUND, "k_side", 36.0, 4.0), (LAUNCH_GAP, "wait for stream 9", 40.0, 1.0),
        (MEMORY_BOUND, "k_last", 41.0, 2.0)]
    assert sum(s.dur_us for s in cp.segments) == cp.total_us


def test_no_node_table_reports_everything_unattributed(tmp_path):
    rep = analyze(load_trace(two_step_decode(step_annotations=True).write(tmp_path / "t.json")))
    assert rep.roofline.attributed_us == 0.0 and rep.roofline.rows == []
    assert rep.roofline.unattributed_reasons == {"trace has no node table": round((57 + 20) / 2, 3)}


def test_diff_names_what_disappeared_and_the_critical_path_gain(tmp_path):
    a = analyze(load_trace(attributed_graph_step().write(tmp_path / "a.json")))
    b = analyze(load_trace(attributed_graph_step(with_mean=False).write(tmp_path / "b.json")))
    d = diff(a, b)
    assert [(c.name, c.a, c.b) for c in d.disappeared] == [("elem_b", 1.0, 0.0)]
    assert d.appeared == [] and d.changed == []
    assert (d.kernels.a, d.kernels.b, d.kernels.delta) == (3, 2, -1)
    total = d.critical_path[0]
    assert (total.name, total.a, total.b, total.delta) == ("total", 31.0, 27.0, -4.0)
    assert {c.name: c.delta for c in d.layers_us} == {"L0": -3.0, UNATTRIBUTED: 0.0}
    text = render_diff(d)
    assert "Kernels that disappeared" in text and "elem_b" in text


def test_command_diff_json_and_html(tmp_path, capsys):
    a = attributed_graph_step().write(tmp_path / "a.json.gz", gz=True)
    b = attributed_graph_step(with_mean=False).write(tmp_path / "b.json.gz", gz=True)
    out_json, out_html = tmp_path / "d.json", tmp_path / "d.html"
    assert run([str(a), "--diff", str(b), "--json", str(out_json), "--html", str(out_html)]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "k3compile.report-diff/1"
    assert doc["diff"]["critical_path"][0] == {"name": "total", "a": 31.0, "b": 27.0}
    assert doc["a"]["roofline"]["fusions"][0]["recoverable_us"] == 4.5
    assert "Critical path (us per step; negative = B gained)" in capsys.readouterr().out
    page = out_html.read_text()
    assert page.count("<svg") == 4 and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


def test_text_report_shows_attribution_roofline_and_fusions(trace_path, capsys):
    assert run([str(trace_path)]) == 0
    text = capsys.readouterr().out
    assert "attributed 9.0 us/step, unattributed 1.0 us/step (1 kernels); launched outside the step graph: 1.0 us" in text
    row = next(line for line in text.splitlines() if line.startswith("mean_1"))
    assert row.split() == ["mean_1", "mean.dim", "L0", "capture", "1", "3.00", "0.50", "16.7%", "166.7", "memory"]
    fusion = next(line for line in text.splitlines() if line.startswith("1 ") and "pow.Tensor_Scalar > mean.dim" in line)
    assert fusion.split()[1:4] == ["4.50", "6.00", "1"]


def _png_pixels(data: bytes):
    """(width, height, rows of RGB(A) tuples) of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(width)])
        prev = line
    return width, height, rows


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_html_renders_its_plots_in_headless_chromium(trace_path, tmp_path):
    trace = load_trace(trace_path)
    report = analyze(trace)
    page = tmp_path / "r.html"
    page.write_text(render_html(report, "text", segment(trace).steps[0].gpu))
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1000,1300", page.as_uri()], check=True, capture_output=True, timeout=120)
    width, height, rows = _png_pixels(shot.read_bytes())
    assert (width, height) == (1000, 1300)
    from collections import Counter
    pixels = Counter(px for row in rows for px in row)

    def rgb(hexcolor):
        return tuple(int(hexcolor[i:i + 2], 16) for i in (1, 3, 5))
    # far more of each colour than the two legends' 12x12 swatches (288 pixels): the timeline's GEMM
    # and copy rectangles, the stacked bars, the layer bars (measured in the GEMM blue, floor in green)
    for cat in ("GEMM", "copy", "norm/elementwise", "other"):
        assert pixels[rgb(COLORS[cat])] > 1000, (cat, pixels[rgb(COLORS[cat])])


def _eager_trace(tmp_path):
    from tests.k3compile.report.synthetic_traces import T0, TraceBuilder
    b = TraceBuilder()
    t = lambda x: T0 + x  # noqa: E731
    b.annotation("decode_step#0", t(0), 100)
    b.kernel_launch("cudaLaunchKernel", t(1), "k_first", t(5), 10)
    b.runtime("cudaStreamSynchronize", t(3), 13)
    b.kernel_launch("cudaLaunchKernel", t(20), "k_a", t(22), 10)
    b.kernel_launch("cudaLaunchKernel", t(23), "k_last", t(41), 2)
    return b.write(tmp_path / "eager.json")


def test_hta_cross_check_on_eager_steps_and_skip_on_graph_replays(tmp_path, capsys):
    from k3compile.report.hta_check import SKIP_GRAPH, available, hta_critical_paths
    if available() is not None:
        pytest.skip(available())
    path = _eager_trace(tmp_path)
    (step,) = hta_critical_paths(str(path), analyze(load_trace(path)))
    # HTA's path (it sees no sync dependency in a trace without cuda_sync events): the launch call of k_a
    # (1 us), launch delay (2), k_a (10), kernel-kernel delay (9), k_last (2)
    assert step.skipped is None and step.total_us == 24.0
    assert step.by_bound == {"cpu_bound": 1.0, "gpu_compute_bound": 12.0, "gpu_kernel_kernel_overhead": 9.0,
                             "gpu_kernel_launch_overhead": 2.0}
    graph = attributed_graph_step().write(tmp_path / "g.json")
    assert [s.skipped for s in hta_critical_paths(str(graph), analyze(load_trace(graph)))] == [SKIP_GRAPH]
    assert run([str(path), "--hta"]) == 0
    assert "HolisticTraceAnalysis critical path" in capsys.readouterr().out


def test_by_op_splits_the_busy_time_over_the_floor_with_pdl_overlap():
    """Two ops on one stream, the second launched under PDL: its kernel starts 2 µs before the first one ends. Its
    exclusive time is what it adds after that end; the rows' exclusive times sum to the busy span."""
    from k3compile.report.attribution import Attribution, NodeInfo
    from k3compile.report.by_op import by_op
    from k3compile.report.roofline import RooflineRow
    from k3compile.report.trace import Event

    def kernel(name, ts_us, dur_us, stream=7):
        return Event(name, "gpu", "kernel", int(ts_us * 1000), int(dur_us * 1000), 0, stream, device=0, stream=stream)

    norm, gemv_a, gemv_b = (NodeInfo("norm_0", "k3.attn_res_norm.default", "L0", "p07", 1_000, 0),
                            NodeInfo("gemv_0", "k3.gemv.default", "L0", "p08", 4_000_000, 0),
                            NodeInfo("gemv_1", "k3.gemv.default", "L1", "p08", 4_000_000, 0))
    steps, attr = [], {}
    for step in range(2):  # two identical steps: rows are per step
        t = 100 * step
        evs = [kernel("norm", t, 4), kernel("gemv", t + 2, 6), kernel("gemv", t + 8, 5), kernel("stray", t + 20, 1)]
        for ev, info in zip(evs, (norm, gemv_a, gemv_b)):
            attr[ev] = Attribution(info)
        attr[evs[3]] = Attribution(None, reason="outside")
        steps.append(evs)
    # roofline.py's per-node rows (per step: kernel time, one launch, bytes, floor), which by_op sums per op
    node_rows = [RooflineRow(info.name, info.op, info.layer, info.pass_, [], 1, time_us, info.bytes, 0, floor_us,
                             None, None, None, "memory", True)
                 for info, time_us, floor_us in ((norm, 4.0, 1.0), (gemv_a, 6.0, 3.0), (gemv_b, 5.0, 4.5))]
    rows = {r.op: r for r in by_op(node_rows, steps, attr)}
    assert list(rows) == ["k3.attn_res_norm.default", "k3.gemv.default"]  # ranked by excess: 3.0 > 1.5
    g, n = rows["k3.gemv.default"], rows["k3.attn_res_norm.default"]
    # gemv_0 runs 2-8 but adds only 4-8 after the norm; gemv_1 8-13
    assert (g.nodes, g.launches_per_step, g.time_us, g.exclusive_us, g.floor_us, g.excess_us) == (2, 2, 11.0, 9.0,
                                                                                                     7.5, 1.5)
    assert (n.exclusive_us, n.excess_us, n.roofline, g.mbytes) == (4.0, 3.0, 0.25, 8.0)
    assert n.exclusive_us + g.exclusive_us == 13.0  # the attributed kernels' busy span, 0-13
