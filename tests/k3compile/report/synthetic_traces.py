"""Build chrome traces shaped like torch.profiler's (CPU ops, CUDA runtime calls, GPU kernels on
streams, ac2g flow events, correlation ids) with hand-chosen times, so tests know every number."""
from __future__ import annotations

import gzip
import json


class TraceBuilder:
    CPU_PID, CPU_TID = 4242, 4242

    def __init__(self, with_correlation_args: bool = True):
        self.with_correlation_args = with_correlation_args
        self.events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": self.CPU_PID, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
        ]
        self._next_corr = 100
        self.extra: dict = {}  # more top-level keys (the "k3compile" node table)
        self.device_properties: dict = {}  # more of device 0's deviceProperties (numSms, ...)

    def annotation(self, name: str, ts: float, dur: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": self.CPU_PID,
                            "tid": self.CPU_TID, "ts": ts, "dur": dur, "args": {}})

    def runtime(self, name: str, ts: float, dur: float) -> None:
        """A CUDA API call that launches nothing (a synchronize)."""
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": self.CPU_PID,
                            "tid": self.CPU_TID, "ts": ts, "dur": dur, "args": {"correlation": 0}})

    def op(self, name: str, ts: float, dur: float) -> None:
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": self.CPU_PID,
                            "tid": self.CPU_TID, "ts": ts, "dur": dur, "args": {}})

    def launch(self, api: str, ts: float, dur: float = 1.0, corr: int | None = None) -> int:
        """A CUDA runtime/driver call on the CPU thread; returns its correlation id."""
        if corr is None:
            corr, self._next_corr = self._next_corr, self._next_corr + 1
        cat = "cuda_driver" if api.startswith("cu") and not api.startswith("cuda") else "cuda_runtime"
        args = {"correlation": corr} if self.with_correlation_args else {}
        self.events.append({"ph": "X", "cat": cat, "name": api, "pid": self.CPU_PID,
                            "tid": self.CPU_TID, "ts": ts, "dur": dur, "args": args})
        self.events.append({"ph": "s", "id": corr, "pid": self.CPU_PID, "tid": self.CPU_TID,
                            "ts": ts, "cat": "ac2g", "name": "ac2g"})
        return corr

    def gpu(self, name: str, corr: int, ts: float, dur: float, stream: int = 7, device: int = 0,
            cat: str = "kernel", launch: dict | None = None) -> None:
        """launch: the profiler's launch args of a kernel ("grid", "block", "registers per thread", ...)."""
        args = {"device": device, "stream": stream, **(launch or {})}
        if self.with_correlation_args:
            args["correlation"] = corr
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream,
                            "ts": ts, "dur": dur, "args": args})
        self.events.append({"ph": "f", "id": corr, "pid": device, "tid": stream, "ts": ts,
                            "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def kernel_launch(self, api: str, launch_ts: float, name: str, ts: float, dur: float,
                      **kw) -> int:
        corr = self.launch(api, launch_ts)
        self.gpu(name, corr, ts, dur, **kw)
        return corr

    def doc(self) -> dict:
        return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", **self.device_properties}],
                "displayTimeUnit": "ms", "traceEvents": self.events, **self.extra}

    def write(self, path, gz: bool = False):
        data = json.dumps(self.doc()).encode()
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if gz else data)
        return path


T0 = 5_099_082_249_000.0  # real traces use large absolute µs timestamps with ns decimals


def two_step_decode(builder: TraceBuilder | None = None, *, step_annotations: bool = False,
                    profiler_steps: bool = True) -> TraceBuilder:
    """Two decode steps on device 0 (streams 7 and 13), times in µs relative to T0.

    Step 1 (CPU 0–100): six eager launches and one cudaGraphLaunch replaying three kernels;
    one kernel launched in step 1 runs after the step's CPU range ended (at 120).
    Step 2 (CPU 130–200): three kernels and a memset.
    Outside both steps: a kernel launched at 210, and one whose launch was not captured.
    """
    b = builder or TraceBuilder()
    t = lambda x: T0 + x  # noqa: E731
    if profiler_steps:
        b.annotation("ProfilerStep#1", t(0), 100)
        b.annotation("ProfilerStep#2", t(130), 70)
    if step_annotations:
        b.annotation("decode_step_1", t(1), 98)
        b.annotation("decode_step_2", t(131), 68)
    # step 1
    b.op("aten::mm", t(9), 3)
    b.kernel_launch("cudaLaunchKernel", t(10), "sm90_xmma_gemm_bf16bf16_bf16f32", t(50), 10)
    b.op("k3::kda_decode", t(19), 3)
    b.kernel_launch("cudaLaunchKernel", t(20), "k3_kda_decode_kernel", t(62), 8)
    b.kernel_launch("cuLaunchKernelEx", t(30), "triton_per_fused_add_rms_norm_0", t(75), 5)
    b.kernel_launch("cudaLaunchKernelExC", t(35), "flash_fwd_splitkv_mla_kernel", t(76), 14, stream=13)
    b.kernel_launch("cudaMemcpyAsync", t(40), "Memcpy DtoD (Device -> Device)", t(81), 1,
                    cat="gpu_memcpy")
    graph = b.launch("cudaGraphLaunch", t(50), 4)
    b.gpu("fused_moe_kernel", graph, t(83), 7)
    b.gpu("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", graph, t(90), 5)
    b.gpu("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float> >",
          graph, t(97), 2)
    b.kernel_launch("cudaLaunchKernel", t(90), "k3_fused_route_kernel", t(120), 5)
    # step 2
    b.kernel_launch("cudaLaunchKernel", t(140), "ampere_bf16_s16816gemm_bf16_64x64_ldg8_f2f_tn",
                    t(150), 10)
    b.kernel_launch("cudaLaunchKernel", t(145), "k3_kda_decode_kernel", t(162), 8)
    b.kernel_launch("cuLaunchKernel", t(150), "mystery_kernel", t(171), 1)
    b.kernel_launch("cudaMemsetAsync", t(155), "Memset (Device)", t(175), 1, cat="gpu_memset")
    # outside every step
    b.kernel_launch("cudaLaunchKernel", t(210), "late_gemm_kernel", t(220), 3)
    b.gpu("orphan_kernel", 999, t(300), 1)
    return b


NODE_TABLE = {  # bytes and FLOPs chosen so that every floor is a round number at the peaks below
    "mm_0": {"op": "aten.mm.default", "layer": "L0", "pass": "p01_gemm_merge", "bytes": 2_000_000,
             "flops": 400_000_000, "exact": True},
    "pow_1": {"op": "aten.pow.Tensor_Scalar", "layer": "L0", "pass": "capture", "bytes": 1_000_000, "flops": 0},
    "mean_1": {"op": "aten.mean.dim", "layer": "L0", "pass": "capture", "bytes": 500_000, "flops": 0},
}


def attributed_graph_step(with_mean: bool = True, decoy: bool = False) -> TraceBuilder:
    """An engine trace: peaks, an attribution run (node by node), then one step replaying a CUDA graph.

    Peaks: a 10 µs copy of 1e7 bytes (1000 GB/s) and a 10 µs GEMM of 1e9 FLOPs (100 TFLOP/s).
    Attribution run (k3.attribution#0, 0–30): mm_0 → a GEMM kernel, pow_1 → elem_a, mean_1 → elem_b.
    decoy: a second attribution run (k3.attribution#1, 40–60, another bucket) whose kernels are named
    differently but for one; the step must still be matched against the first.
    Step decode_step#0 (100–200): cudaMemcpyAsync at 101 (a 1 µs copy at 105, outside the graph),
    cudaGraphLaunch at 110–115 replaying gemm 120–124, elem_a 125–127, elem_b 128–131.
    """
    b = TraceBuilder()
    t = lambda x: T0 + x  # noqa: E731
    nodes = dict(NODE_TABLE)
    if not with_mean:
        nodes.pop("mean_1")
    b.extra["k3compile"] = {"schema": "k3compile.nodes/1",
                            "attribution": [{"label": "decode bs=1", "range": "k3.attribution#0", "nodes": nodes}],
                            "peaks": {"copy": {"range": "k3.peak/copy", "bytes": 10_000_000},
                                      "gemm": {"range": "k3.peak/gemm", "flops": 1_000_000_000}}}
    b.annotation("k3.peak/copy", t(-60), 20)
    b.kernel_launch("cudaMemcpyAsync", t(-59), "Memcpy DtoD (Device -> Device)", t(-55), 10, cat="gpu_memcpy")
    b.annotation("k3.peak/gemm", t(-30), 20)
    b.kernel_launch("cudaLaunchKernel", t(-29), "sm90_xmma_gemm_peak", t(-25), 10)
    # a library helper launched in the same range (a workspace memset beside the GEMM) is not the peak op
    b.kernel_launch("cudaLaunchKernel", t(-28), "cublas_workspace_memset", t(-14), 1)
    b.annotation("k3.attribution#0", t(0), 30)
    b.annotation("k3.node/mm_0", t(1), 4)
    b.kernel_launch("cudaLaunchKernel", t(2), "sm90_xmma_gemm_bf16", t(10), 4)
    b.annotation("k3.node/pow_1", t(6), 3)
    b.kernel_launch("cudaLaunchKernel", t(7), "elem_a", t(15), 2)
    if with_mean:
        b.annotation("k3.node/mean_1", t(10), 3)
        b.kernel_launch("cudaLaunchKernel", t(11), "elem_b", t(18), 2)
    if decoy:
        b.extra["k3compile"]["attribution"].append({"label": "decode bs=8", "range": "k3.attribution#1", "nodes": {
            "mm_8": {"op": "aten.mm.default", "layer": "L5", "pass": "capture", "bytes": 1, "flops": 0},
            "add_8": {"op": "aten.add.Tensor", "layer": "L5", "pass": "capture", "bytes": 1, "flops": 0}}})
        b.annotation("k3.attribution#1", t(40), 20)
        b.annotation("k3.node/mm_8", t(41), 4)
        b.kernel_launch("cudaLaunchKernel", t(42), "sm90_xmma_gemm_bf16_bs8", t(50), 4)
        b.annotation("k3.node/add_8", t(46), 3)
        b.kernel_launch("cudaLaunchKernel", t(47), "elem_a", t(55), 2)
    b.annotation("decode_step#0", t(100), 100)
    b.kernel_launch("cudaMemcpyAsync", t(101), "Memcpy HtoD (Pageable -> Device)", t(105), 1, cat="gpu_memcpy")
    graph = b.launch("cudaGraphLaunch", t(110), 5)
    b.gpu("sm90_xmma_gemm_bf16", graph, t(120), 4)
    b.gpu("elem_a", graph, t(125), 2)
    if with_mean:
        b.gpu("elem_b", graph, t(128), 3)
    return b
