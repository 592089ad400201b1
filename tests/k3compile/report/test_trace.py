"""Loading chrome traces: plain and gzipped, correlation from args or from flow events, clear errors."""
import gzip
import json

import pytest

from k3compile.report.trace import KERNEL, MEMCPY, MEMSET, RUNTIME, TraceError, load_trace
from tests.k3compile.report.synthetic_traces import T0, TraceBuilder, two_step_decode


def test_loads_events_streams_and_launches(tmp_path):
    trace = load_trace(two_step_decode().write(tmp_path / "t.json"))
    kinds = [e.kind for e in trace.gpu_events]
    assert kinds.count(KERNEL) == 13 and kinds.count(MEMCPY) == 1 and kinds.count(MEMSET) == 1
    assert sorted(trace.streams) == [(0, 7), (0, 13)]
    assert [e.name for e in trace.streams[(0, 13)].events] == ["flash_fwd_splitkv_mla_kernel"]
    assert trace.device_names == {0: "NVIDIA H200"}
    # times are exact integer nanoseconds, even on large absolute timestamps
    gemm = next(e for e in trace.gpu_events if e.name.startswith("sm90_xmma"))
    assert gemm.ts == round(T0 * 1000) + 50_000 and gemm.dur == 10_000
    launch = trace.launch_of(gemm)
    assert launch.kind == RUNTIME and launch.name == "cudaLaunchKernel"
    # the three graph-replayed kernels share their cudaGraphLaunch's correlation id
    graph = [e for e in trace.gpu_events if trace.launch_of(e) and trace.launch_of(e).name == "cudaGraphLaunch"]
    assert len(graph) == 3
    orphan = next(e for e in trace.gpu_events if e.name == "orphan_kernel")
    assert trace.launch_of(orphan) is None


def test_flow_events_link_launches_when_args_lack_correlation(tmp_path):
    with_args = load_trace(two_step_decode().write(tmp_path / "a.json"))
    flows_only = load_trace(two_step_decode(TraceBuilder(with_correlation_args=False)).write(tmp_path / "f.json"))
    assert not any("correlation" in e.args for e in flows_only.events)
    assert all(e.correlation is not None for e in flows_only.gpu_events)
    link = lambda t: [(e.name, t.launch_of(e).name if t.launch_of(e) else None) for e in t.gpu_events]  # noqa: E731
    assert link(flows_only) == link(with_args)


def test_gzipped_trace_is_read_whatever_its_name(tmp_path):
    plain = load_trace(two_step_decode().write(tmp_path / "t.json"))
    zipped = load_trace(two_step_decode().write(tmp_path / "t.pt.trace.json.gz", gz=True))
    misnamed = load_trace(two_step_decode().write(tmp_path / "t2.json", gz=True))
    assert [e.name for e in zipped.events] == [e.name for e in plain.events] == [e.name for e in misnamed.events]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file not found: .*nope.json"):
        load_trace(tmp_path / "nope.json")


@pytest.mark.parametrize("content,message", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b'{"schemaVersion": 1}', "no top-level 'traceEvents'"),
    (b"[1, 2, 3]", "no top-level 'traceEvents'"),
    (b'{"traceEvents": {"a": 1}}', "'traceEvents' is a dict, not a list"),
    (b'{"traceEvents": [1]}', "event #0 is a int, not an object"),
    (b'{"traceEvents": [{"ph": "X", "name": "k", "cat": "kernel", "dur": 1}]}', "event #0 \\('k'\\) has no numeric 'ts'"),
    (b'{"traceEvents": [{"ph": "X", "name": "k", "cat": "kernel", "ts": 1, "dur": 1, "pid": "gpu", "tid": "s"}]}',
     "names no device/stream"),
    (gzip.compress(b'{"traceEvents": []}', mtime=0)[:-6], "gzip data is corrupt"),
])
def test_bad_input_names_file_and_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_directory_is_refused(tmp_path):
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)


def test_empty_trace_loads(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": []}))
    trace = load_trace(path)
    assert trace.events == [] and trace.gpu_events == [] and trace.streams == {}
