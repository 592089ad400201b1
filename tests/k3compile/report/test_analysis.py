"""Exact per-step numbers on a synthetic two-step decode trace whose every time is chosen by hand
(see `two_step_decode`)."""
import pytest

from k3compile.report.analysis import GRAPH_REPLAY, NO_OP, analyze, busy_time, launch_gaps, top_by_total
from k3compile.report.steps import FROM_ANNOTATIONS, FROM_PROFILER_STEPS, WHOLE_TRACE, segment
from k3compile.report.trace import exclusive_ns, load_trace
from tests.k3compile.report.synthetic_traces import T0, TraceBuilder, two_step_decode


def counts(step):
    return {c: s.count for c, s in step.by_category.items() if s.count}


@pytest.fixture
def report(tmp_path):
    return analyze(load_trace(two_step_decode().write(tmp_path / "t.json")))


def test_steps_come_from_profiler_steps(report):
    assert report.step_source == FROM_PROFILER_STEPS
    assert [s.name for s in report.steps] == ["ProfilerStep#1", "ProfilerStep#2"]
    assert [s.cpu_dur_us for s in report.steps] == [100.0, 70.0]


def test_step_one_categories_include_graph_replay_and_late_kernel(report):
    s1 = report.steps[0]
    assert counts(s1) == {"GEMM": 1, "KDA": 1, "attention": 1, "MoE": 2, "norm/elementwise": 2,
                          "copy": 1, "communication": 1}
    assert (s1.kernels, s1.memcpy, s1.memset) == (8, 1, 0)
    assert (s1.graph_replayed, s1.graph_launches, s1.launch_calls) == (3, 1, 7)
    assert s1.by_category["MoE"].time_us == 12.0  # fused_moe (graph) 7 + k3_fused_route (late) 5
    assert s1.gpu_time_us == 57.0


def test_step_two_categories(report):
    s2 = report.steps[1]
    assert counts(s2) == {"GEMM": 1, "KDA": 1, "copy": 1, "other": 1}
    assert (s2.kernels, s2.memcpy, s2.memset) == (3, 0, 1)
    assert (s2.graph_replayed, s2.graph_launches, s2.launch_calls) == (0, 0, 4)


def test_launch_gaps_per_stream_and_step(report):
    s1, s2 = report.steps
    gaps = {(g.device, g.stream): (g.events, g.count, g.total_us, g.largest_us) for g in s1.gaps}
    # stream 7: gemm 50-60, kda 62-70, rms 75-80, memcpy 81-82, moe 83-90, nccl 90-95,
    # add 97-99, route 120-125 → gaps 2, 5, 1, 1, (0), 2, 21
    assert gaps == {(0, 7): (8, 6, 32.0, 21.0), (0, 13): (1, 0, 0.0, 0.0)}
    assert (s1.gap_count, s1.gap_total_us, s1.gap_largest_us) == (6, 32.0, 21.0)
    # stream 7: 150-160, 162-170, 171-172, 175-176 → gaps 2, 1, 3
    assert (s2.gap_count, s2.gap_total_us, s2.gap_largest_us) == (3, 6.0, 3.0)


def test_busy_fraction(report):
    s1, s2 = report.steps
    # union: 50-60, 62-70, 75-95 (rms, flash on stream 13, memcpy, moe, nccl), 97-99, 120-125
    assert (s1.gpu_busy_us, s1.gpu_span_us, s1.busy_fraction) == (45.0, 75.0, 0.6)
    assert (s2.gpu_busy_us, s2.gpu_span_us, s2.busy_fraction) == (20.0, 26.0, round(20 / 26, 4))
    assert report.mean["busy_fraction"] == round((0.6 + round(20 / 26, 4)) / 2, 4)


def test_events_outside_steps_are_counted_not_attributed(report):
    assert report.outside_steps == 2  # launched at 210, and the one with no captured launch
    names = [k.name for k in report.top_kernels]
    assert "late_gemm_kernel" not in names and "orphan_kernel" not in names


def test_top_kernels_order(report):
    top = [(k.name, k.count, k.total_us, k.mean_us) for k in report.top_kernels[:5]]
    assert top == [
        ("k3_kda_decode_kernel", 2, 16.0, 8.0),
        ("flash_fwd_splitkv_mla_kernel", 1, 14.0, 14.0),
        # equal totals and counts: by name
        ("ampere_bf16_s16816gemm_bf16_64x64_ldg8_f2f_tn", 1, 10.0, 10.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 1, 10.0, 10.0),
        ("fused_moe_kernel", 1, 7.0, 7.0),
    ]
    assert report.top_kernels[0].category == "KDA"
    assert report.top_kernels[0].share == round(16 / 77, 4)  # 57 + 20 µs of GPU time in steps
    assert len(report.top_kernels) == 12  # distinct GPU event names in the steps (< top=15)
    assert len(analyze(load_trace(report.path), top=3).top_kernels) == 3


def test_user_annotations_win_over_profiler_steps(tmp_path):
    path = two_step_decode(step_annotations=True).write(tmp_path / "t.json")
    report = analyze(load_trace(path))
    assert report.step_source == FROM_ANNOTATIONS
    assert [s.name for s in report.steps] == ["decode_step_1", "decode_step_2"]
    assert [s.kernels for s in report.steps] == [8, 3]
    assert report.outside_steps == 2


def test_custom_step_pattern_and_nested_annotations(tmp_path):
    b = two_step_decode(profiler_steps=False)
    b.annotation("my_step", T0 + 0, 200)
    b.annotation("my_step_inner", T0 + 5, 50)  # nested: not a step of its own
    report = analyze(load_trace(b.write(tmp_path / "t.json")), step_pattern=r"^my_step")
    assert [s.name for s in report.steps] == ["my_step"]
    assert report.steps[0].kernels == 11 and report.outside_steps == 2


def test_without_step_ranges_the_whole_trace_is_one_step(tmp_path):
    report = analyze(load_trace(two_step_decode(profiler_steps=False).write(tmp_path / "t.json")))
    assert report.step_source == WHOLE_TRACE
    (step,) = report.steps
    assert step.kernels == 13 and step.memcpy == 1 and step.memset == 1
    assert report.outside_steps == 0  # even the kernel whose launch was not captured


def test_flow_linked_trace_gives_the_same_report(tmp_path):
    a = analyze(load_trace(two_step_decode().write(tmp_path / "a.json")))
    b = analyze(load_trace(two_step_decode(TraceBuilder(with_correlation_args=False)).write(tmp_path / "b.json")))
    assert a.steps == b.steps and a.top_kernels == b.top_kernels


def test_cpu_ops_per_step_count_only_top_level_ops(tmp_path):
    b = two_step_decode()
    b.op("aten::linear", T0 + 131, 10)
    b.op("aten::addmm", T0 + 132, 5)  # called by aten::linear: not counted again
    seg = segment(load_trace(b.write(tmp_path / "t.json")))
    assert [e.name for e in seg.steps[0].cpu_ops] == ["aten::mm", "k3::kda_decode"]
    assert [e.name for e in seg.steps[1].cpu_ops] == ["aten::linear"]


def test_gap_and_busy_helpers_ignore_overlap(tmp_path):
    b = TraceBuilder()
    b.kernel_launch("cudaLaunchKernel", 1, "a", 10, 10)
    b.kernel_launch("cudaLaunchKernel", 2, "b", 12, 3)   # inside a: no gap, no extra busy time
    b.kernel_launch("cudaLaunchKernel", 3, "c", 25, 5)
    events = load_trace(b.write(tmp_path / "t.json")).gpu_events
    (g,) = launch_gaps(events)
    assert (g.count, g.total_us, g.largest_us) == (1, 5.0, 5.0)
    assert busy_time(events) == 15_000


def test_exclusive_time_is_what_each_kernel_adds_after_its_predecessor(tmp_path):
    """PDL-style overlap on one stream: b starts inside a (its wait) and ends 4 us after it, c inside b entirely, d
    after a gap; exclusive times are 10, 4, 0, 5 us and sum to the stream's busy time; the top-kernels rows carry
    them (total and per call) next to the plain durations."""
    b = TraceBuilder()
    b.kernel_launch("cudaLaunchKernel", 1, "a", 10, 10)
    b.kernel_launch("cudaLaunchKernel", 2, "b", 15, 9)   # 15..24: 4 us after a's end at 20
    b.kernel_launch("cudaLaunchKernel", 3, "c", 16, 2)   # inside b
    b.kernel_launch("cudaLaunchKernel", 4, "d", 30, 5)
    events = load_trace(b.write(tmp_path / "t.json")).gpu_events
    excl = exclusive_ns(events)
    assert {e.name: excl[id(e)] for e in events} == {"a": 10_000, "b": 4_000, "c": 0, "d": 5_000}
    assert sum(excl.values()) == busy_time(events)
    stats = {k.name: (k.total_us, k.exclusive_us, k.exclusive_mean_us) for k in top_by_total(events, 10)}
    assert stats == {"a": (10.0, 10.0, 10.0), "b": (9.0, 4.0, 4.0), "c": (2.0, 0.0, 0.0), "d": (5.0, 5.0, 5.0)}


def test_gpu_work_is_attributed_to_the_top_level_op_that_launched_it(tmp_path):
    b = two_step_decode()
    b.op("aten::linear", T0 + 139, 3)
    b.op("aten::addmm", T0 + 139.5, 1.5)  # inner op: the launch at 140 still belongs to aten::linear
    rows = analyze(load_trace(b.write(tmp_path / "t.json"))).launching_ops
    assert [(r.op, r.kernels, r.copies, r.gpu_us, r.share) for r in rows] == [
        (NO_OP, 3.5, 1.0, 17.5, 0.4545),         # 7 events over 2 steps, memcpy + memset are copies
        (GRAPH_REPLAY, 1.5, 0.0, 7.0, 0.1818),   # the three kernels one cudaGraphLaunch replays
        ("aten::linear", 0.5, 0.0, 5.0, 0.1299),
        ("aten::mm", 0.5, 0.0, 5.0, 0.1299),
        ("k3::kda_decode", 0.5, 0.0, 4.0, 0.1039),
    ]
