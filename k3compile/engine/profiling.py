"""torch.profiler traces of engine steps that `k3compile report` can attribute kernel by kernel.

    trace = profile_steps(lambda: executor.run(batch), 3, "out/engine.json.gz", device,
                          attribution=[AttributionRun("decode bs=1", gm, step_args)])

A CUDA-graph replay gives the profiler no CPU context for its kernels: they all hang off one
cudaGraphLaunch. So the same profiling session first runs each step graph once *outside* the
graph, node by node through an fx Interpreter, inside a `k3.attribution#i` range with one
`k3.node/<name>` range per node. The report reads which kernels each node launched there and
matches the replays' kernel sequences against that (by order and name, report/attribution.py).

While it runs each node, the interpreter also records what the roofline needs: the FLOPs
(torch.utils.flop_counter's formulas for aten ops, our own for the k3 ops) and the bytes the node must
move (inputs + outputs; for gathers and pool ops only the rows they touch, see `node_cost`).
Everything goes into the trace file under the top-level key "k3compile" (TRACE_KEY), together
with each node's layer and pass (engine/provenance.py), so one file carries the whole story.

The attribution run executes the step once more: give it inputs whose writes do no harm (the
bench rewrites the same rows every step; a live server passes padding rows, `padding_step_args`).
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass

import torch
import torch.fx

from .provenance import node_provenance

TRACE_KEY = "k3compile"
NODE_TABLE_SCHEMA = "k3compile.nodes/1"
ATTRIBUTION_RANGE = "k3.attribution"
NODE_RANGE = "k3.node/"
STEP_RANGE = "decode_step"  # matches k3compile report's default step pattern
PEAK_RANGE = "k3.peak/"
PEAK_COPY_BYTES = 1 << 30   # a 1 GiB device copy: long enough to reach HBM bandwidth
PEAK_GEMM_N = 8192          # an 8192^3 bf16 GEMM: long enough to reach tensor-core throughput
PEAK_REPS = 3


@dataclass
class AttributionRun:
    label: str                  # e.g. "decode bs=1"
    graph: torch.fx.GraphModule
    args: tuple                 # the step's inputs (STEP_INPUTS order)


# ------------------------------------------------------------------------------------------ costs

def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors(values) -> list[torch.Tensor]:
    out, seen = [], set()

    def visit(v):
        if isinstance(v, torch.Tensor):
            key = (v.data_ptr(), tuple(v.shape), v.dtype)
            if key not in seen:
                seen.add(key)
                out.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
    visit(values)
    return out


def _sum(ts) -> int:
    return sum(_nbytes(t) for t in ts)


def _k3_cost(name: str, args: tuple, out) -> tuple[int, int] | None:
    """(bytes, flops) of our pool / MoE ops: only the pool rows and experts they touch count."""
    out_b = _sum(_tensors(out))
    if name == "kda_decode":  # q, k, v, g, beta, ssm_pool, layer, slots: read + write each request's state
        q, k, v, g, beta, pool, layer, slots = args[:8]
        b, h, dk = q.shape
        state = _nbytes(pool[0, layer])
        return _sum((q, k, v, g, beta, slots)) + out_b + 2 * slots.numel() * state, 6 * b * h * dk * v.shape[-1]
    if name == "short_conv_decode":  # x, weight, conv_pool, layer, channel_offset, slots
        x, weight, pool, layer, offset, slots = args[:6]
        window = x.shape[1] * pool.shape[-1] * pool.element_size()
        return _sum((x, weight, slots)) + out_b + 2 * slots.numel() * window, 2 * x.numel() * weight.shape[-1]
    if name == "fused_kda_decode":  # P5: the convs, gates, recurrence and gated norm of one KDA layer
        conv_pool, pool, layer, slots = args[12:16]
        b, c = args[0].shape
        low_rank = [w for w in args[18:20] if isinstance(w, torch.Tensor)]
        dense = [a for i, a in enumerate(args[:12]) if isinstance(a, torch.Tensor)] + low_rank + [slots]
        per_request = 2 * (_nbytes(pool[0, layer]) + _nbytes(conv_pool[0, layer]))
        k_dim = c // pool.shape[2]
        gemv = sum(2 * b * w.numel() for w in low_rank)
        return _sum(dense) + out_b + b * per_request, 6 * b * c * k_dim + gemv
    if name == "kv_write":  # rows, kv_pool, layer, out_cache_loc
        rows, pool, layer, loc = args[:4]
        return _sum((rows, loc)) + loc.numel() * _nbytes(pool[0, layer, 0]), 0
    if name == "mla_decode":  # q_lat, kv_pool, layer, page_table, seq_lens, ...: reads each request's context rows
        q, pool, layer, table, seq_lens = args[:5]
        ctx = int(seq_lens.sum())
        row = pool[0, layer, 0]
        return (_sum((q, seq_lens)) + out_b + ctx * _nbytes(row) + table.shape[0] * table.shape[1] * 4,
                4 * q.shape[1] * ctx * row.numel())
    if name == "moe_experts":  # x, topk_ids, topk_weights, w13, w2: reads the weights of the experts routed to
        x, ids, weights, w13, w2 = args[:5]
        experts = int(torch.unique(ids).numel())
        return (_sum((x, ids, weights)) + out_b + experts * (_nbytes(w13[0]) + _nbytes(w2[0])),
                2 * ids.numel() * (w13[0].numel() + w2[0].numel()))
    if name == "fused_moe_decode":  # P6: routed experts touched + shared expert + latent tail, one layer
        x, ids, weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2 = args[:10]
        # the latent tail's weights and shared_w13 (the shared expert's gate/up, when kernel A runs them): GEMVs
        tail = [w for w in args[14:16] + args[18:19] if isinstance(w, torch.Tensor)]
        experts = int(torch.unique(ids).numel())
        per_expert = sum(_nbytes(w[0]) for w in (w13, w2, w13_scale, w2_scale) if isinstance(w, torch.Tensor))
        dense = [t for t in (x, ids, weights, shared_in, shared_up, shared_w2) if isinstance(t, torch.Tensor)]
        b = x.shape[0]
        gemv = sum(2 * b * w.numel() for w in [shared_w2] + tail if isinstance(w, torch.Tensor))
        return (_sum(dense + tail) + out_b + experts * per_expert,
                2 * ids.numel() * (w13[0].numel() + w2[0].numel()) + gemv)
    return None


def aten_flops(target, args: tuple, kwargs: dict, out) -> int:
    """FLOPs from torch.utils.flop_counter's formulas (matmuls, attention, convolutions), called on
    the shapes directly: running the node under FlopCounterMode could decompose it into other
    kernels than the graph replay launches, which would spoil the kernel matching."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(target, "overloadpacket", None)
    if packet is None or packet not in flop_registry:
        return 0
    try:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments: no FLOPs known
        return 0


_GATHERS = {"aten.embedding.default": 0, "aten.index.Tensor": 0, "aten.index_select.default": 0}


def node_cost(target, args: tuple, kwargs: dict, out, flops: int) -> dict:
    """{"bytes", "flops", "exact"}: what the node must move and compute at minimum.

    aten ops: every distinct input and output tensor once (a gather reads only the rows it returns);
    FLOPs from torch's flop formulas (`aten_flops`: matmuls, attention, convolutions; 0 for elementwise ops).
    k3 ops: per-op formulas (`_k3_cost`). Anything else that reads a whole step pool would count
    the pool, which it does not read: those are marked exact=False and their bytes leave the pool out.
    """
    name = str(target)
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "k3":
        got = _k3_cost(target._opname, args, out)
        if got is not None:
            return {"bytes": got[0], "flops": max(flops, got[1]), "exact": True}
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    if name in _GATHERS:
        table = args[_GATHERS[name]]
        ins = [t for t in ins if t is not table]
    return {"bytes": _sum(ins) + _sum(outs), "flops": int(flops), "exact": True}


# ------------------------------------------------------------------------------- attribution run

class RangedInterpreter(torch.fx.Interpreter):
    """Runs a step graph node by node, each call inside a `k3.node/<name>` profiler range, and
    records each node's cost."""

    def __init__(self, gm: torch.fx.GraphModule, pools: tuple = ()):
        super().__init__(gm, garbage_collect_values=True)
        self.costs: dict[str, dict] = {}
        self._pools = {p.untyped_storage().data_ptr() for p in pools}

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        from torch.profiler import record_function

        args, kwargs = self.fetch_args_kwargs_from_env(n)
        with record_function(NODE_RANGE + n.name):
            out = self.call_function(n.target, args, kwargs)
        cost = node_cost(n.target, args, kwargs, out, aten_flops(n.target, args, kwargs, out))
        if self._pools and not (isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "k3"):
            touched = [t for t in _tensors((args, kwargs)) if t.untyped_storage().data_ptr() in self._pools]
            if touched:  # a view or copy of a whole pool: its true footprint is unknown here
                cost["bytes"] -= _sum(touched)
                cost["exact"] = False
        self.costs[n.name] = cost
        return out


def attribution_table(run: AttributionRun, index: int, pools: tuple = ()) -> dict:
    """Run the graph once under the profiler's ranges; the node table for the trace."""
    from torch.profiler import record_function

    interp = RangedInterpreter(run.graph, pools)
    with torch.no_grad(), record_function(f"{ATTRIBUTION_RANGE}#{index}"):
        interp.run(*run.args)
    nodes = {}
    for name, prov in node_provenance(run.graph).items():
        nodes[name] = {**prov, **interp.costs.get(name, {"bytes": 0, "flops": 0, "exact": True})}
    return {"label": run.label, "range": f"{ATTRIBUTION_RANGE}#{index}", "nodes": nodes}


def padding_step_args(executor, batch_size: int) -> tuple:
    """Decode-step inputs whose every row is the executor's padding request (token 0, state slot 0,
    KV page 0, context 1): running them writes only the reserved sinks, never a live request's state."""
    dev, c = executor.device, executor.cache
    i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
    b = batch_size
    return (torch.zeros(b, **i64), torch.arange(b + 1, **i32), torch.ones(b, **i32),
            torch.zeros(b, executor.max_pages, **i32), torch.zeros(b, **i64), torch.zeros(b, **i64),
            torch.arange(b, **i64), c.ssm, c.conv, c.kv)


# ----------------------------------------------------------------------------- peaks, same run

def measure_peaks(device) -> dict:
    """Inside the profiling session: a large copy and a large GEMM, each PEAK_REPS times in its own
    range; the report divides their sizes by the fastest repetition's kernel time."""
    from torch.profiler import record_function

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    src = torch.empty(PEAK_COPY_BYTES // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    with record_function(PEAK_RANGE + "copy"):
        for _ in range(PEAK_REPS):
            dst.copy_(src)
    sync(device)
    del src, dst
    n = PEAK_GEMM_N
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    torch.mm(a, b)
    with record_function(PEAK_RANGE + "gemm"):
        for _ in range(PEAK_REPS):
            torch.mm(a, b)
    sync(device)
    del a, b
    torch.cuda.empty_cache()
    return {"copy": {"range": PEAK_RANGE + "copy", "bytes": 2 * PEAK_COPY_BYTES, "note": "bytes read + written"},
            "gemm": {"range": PEAK_RANGE + "gemm", "flops": 2 * n ** 3, "dtype": "bfloat16"}}


# ------------------------------------------------------------------------------------ the trace

def write_trace(prof, path: str, tables: list[dict], peaks: dict | None = None) -> str:
    """Export the profiler's chrome trace to `path` (gzipped when it ends in .gz) with the node tables."""
    raw = path.removesuffix(".gz") + ".tmp"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        doc = json.load(f)
    os.remove(raw)
    if tables or peaks:
        doc[TRACE_KEY] = {"schema": NODE_TABLE_SCHEMA, "attribution": tables, "peaks": peaks or {}}
    data = json.dumps(doc).encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=6) if path.endswith(".gz") else data)
    return path


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(run_step, steps: int, path: str, device, attribution: list[AttributionRun] = (),
                  pools: tuple = (), peaks: bool = True) -> str:
    """Profile `steps` calls of run_step() (each in a `decode_step#i` range) after the attribution
    runs (and, on CUDA with `peaks`, the peak copy and GEMM); write the trace to `path`."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    tables, peak_sizes = [], {}
    with profile(activities=acts) as prof:
        if peaks:
            peak_sizes = measure_peaks(device)
        for i, run in enumerate(attribution):
            tables.append(attribution_table(run, i, pools))
            sync(device)
        for i in range(steps):
            with record_function(f"{STEP_RANGE}#{i}"):
                run_step()
            sync(device)
    return write_trace(prof, path, tables, peak_sizes)
