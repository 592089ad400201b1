"""The arms of `k3compile bench decode`: ways to run the same decode step on the same batch.

    eager                    model_def's step, op by op (the reference path)
    compile-max-autotune     torch.compile(step, mode="max-autotune-no-cudagraphs")
    compile-reduce-overhead  torch.compile(step, mode="reduce-overhead") (Inductor + CUDA-graph trees)
    graphs                   the captured, unpassed step graph replayed from CUDA graphs (our executor)
    engine                   the engine (passes P1-P4) replayed from CUDA graphs (our executor)
    engine-served            the same engine through an executor built as `serve` builds it: every decode bucket of
                             the engine captured, the page-table capacity of the served default context (the
                             MLA decode kernel's split count follows that capacity; `engine` sizes it to --context)
    engine-inductor          the engine's decode graph through Inductor, then CUDA graphs (opt-in)

Each arm's `make(ctx, batch)` returns a zero-argument function that runs one decode step and
returns the logits; setup work (compilation, graph capture) happens in `make` or the first calls,
which the bench keeps out of the timed steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from k3compile.capture import step_args
from k3compile.runtime.executor import Executor

COMPILE_MODES = {"compile-max-autotune": "max-autotune-no-cudagraphs", "compile-reduce-overhead": "reduce-overhead"}


@dataclass
class BenchContext:
    model: torch.nn.Module
    cache: object  # CacheTensors shared by every arm (contents do not matter to timing)
    # the same pools as separate tensors: aot_autograd cannot trace in-place updates of two views of one
    # buffer (the runtime's slot layout puts the KDA state and conv window in one), so torch.compile gets these
    cache_unaliased: object
    device: torch.device
    context: int
    get_engine: Callable[[], object]  # the post-pass provider (built or loaded on first use)
    get_unpassed: Callable[[], object]  # {"decode": captured graph}
    compile_dynamic: bool = True
    bounded_autotune: bool = False  # max-autotune without its per-kernel coordinate-descent tuning
    # page-table capacity (max_context) of the executor arms' graphs; None: `context` (--executor-context)
    executor_context: int | None = None
    compiled: dict = field(default_factory=dict)  # arm name -> compiled step (shared across batch sizes)
    notes: dict = field(default_factory=dict)  # arm name -> how it was built (fullgraph or not, ...)


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    needs_cuda: str | None  # why, when it does
    make: Callable


def _eager(ctx: BenchContext, batch):
    args = step_args(batch, ctx.cache)
    return lambda: ctx.model.step_tensors("decode", *args)


def _compiled(ctx: BenchContext, batch, arm: str):
    mode = COMPILE_MODES[arm]
    if arm not in ctx.compiled:
        model = ctx.model

        def decode_step(*a):
            return model.step_tensors("decode", *a)
        if mode == "reduce-overhead":
            # the pools are mutated in place and never move: static addresses keep CUDA-graph trees
            # from copying them into private buffers (and from refusing to graph a mutated input)
            for t in (ctx.cache_unaliased.ssm, ctx.cache_unaliased.conv, ctx.cache_unaliased.kv):
                torch._dynamo.mark_static_address(t)
        ctx.notes[arm] = {"mode": mode, "fullgraph": True, "dynamic": ctx.compile_dynamic,
                          "pools": "separate tensors (aot_autograd cannot mutate two views of one buffer)"}
        kw = {"mode": mode}
        if mode == "max-autotune-no-cudagraphs" and ctx.bounded_autotune:
            # the mode's options minus coordinate-descent tuning of every pointwise/reduction kernel,
            # which dominates compile time on a large unrolled step; GEMM autotuning stays
            kw = {"options": {"max_autotune": True, "coordinate_descent_tuning": False}}
            ctx.notes[arm].update(mode="options equal to max-autotune-no-cudagraphs but coordinate descent off",
                                  options=kw["options"])
        ctx.compiled[arm] = _compile_fullgraph_if_possible(decode_step, kw, ctx.compile_dynamic, ctx.notes[arm])
    fn = ctx.compiled[arm]
    args = step_args(batch, ctx.cache_unaliased)
    if mode == "reduce-overhead":
        def run():
            torch.compiler.cudagraph_mark_step_begin()  # outputs of the previous replay may be overwritten
            return fn(*args)
        return run
    return lambda: fn(*args)


def _compile_fullgraph_if_possible(fn, kw: dict, dynamic: bool, notes: dict):
    """torch.compile(fullgraph=True, **kw); if Dynamo cannot trace the step as one graph, fall back to graph
    breaks (recorded in notes) rather than dropping the baseline."""
    state = {"fn": torch.compile(fn, fullgraph=True, dynamic=dynamic, **kw)}

    def call(*args):
        try:
            return state["fn"](*args)
        except torch._dynamo.exc.Unsupported as e:
            if not notes["fullgraph"]:
                raise
            notes.update(fullgraph=False, graph_break=str(e).splitlines()[0][:300])
            state["fn"] = torch.compile(fn, fullgraph=False, dynamic=dynamic, **kw)
            return state["fn"](*args)
    return call


def _executor(ctx: BenchContext, batch, provider, compile_decode=None):
    cache = ctx.cache_unaliased if compile_decode else ctx.cache
    ex = Executor(provider, cache, device=ctx.device, cuda_graphs=ctx.device.type == "cuda",
                  buckets=(batch.batch_size,), max_context=ctx.executor_context or ctx.context,
                  compile_decode=compile_decode)

    def run():
        return ex.run(batch)
    run.executor = ex  # bench ladder's accuracy gate runs other batches of this size through it
    return run


def served_context(config) -> int:
    """The context `serve` gives an engine by default (runtime/engine.py's default_context; a memory budget too
    small for it caps it lower, not the case on a GPU)."""
    from k3compile.runtime.engine import default_context

    return default_context(config)


def _served_executor(ctx: BenchContext, batch):
    """The engine behind an Executor made the way the served path's ModelRunner makes it: the engine's decode
    buckets (all captured, once, shared by the batch sizes) and max_context = the served default context."""
    from k3compile.runtime.executor import DECODE_BUCKETS

    if "engine-served" not in ctx.compiled:
        engine = ctx.get_engine()
        buckets = getattr(engine, "decode_buckets", None) or DECODE_BUCKETS
        context = served_context(ctx.model.config)
        ctx.compiled["engine-served"] = Executor(engine, ctx.cache, device=ctx.device,
                                                 cuda_graphs=ctx.device.type == "cuda", buckets=buckets,
                                                 max_context=context)
        ctx.notes["engine-served"] = {"buckets": list(buckets), "max_context": context}
    ex = ctx.compiled["engine-served"]

    def run():
        return ex.run(batch)
    run.executor = ex
    return run


CUDA_ONLY_COMPILE = ("needs CUDA: torch.compile baselines are measured on the GPU (Inductor's CPU build of "
                     "the whole step takes minutes on a small CPU and is not a deployment target)")

ARMS = {a.name: a for a in (
    Arm("eager", "model_def step, eager", None, _eager),
    Arm("compile-max-autotune", 'torch.compile(mode="max-autotune-no-cudagraphs")', CUDA_ONLY_COMPILE,
        lambda ctx, b: _compiled(ctx, b, "compile-max-autotune")),
    Arm("compile-reduce-overhead", 'torch.compile(mode="reduce-overhead")', CUDA_ONLY_COMPILE,
        lambda ctx, b: _compiled(ctx, b, "compile-reduce-overhead")),
    Arm("graphs", "captured step graph, no passes, CUDA graphs", "needs CUDA (CUDA graphs)",
        lambda ctx, b: _executor(ctx, b, ctx.get_unpassed())),
    Arm("engine", "engine (P1-P4) + CUDA graphs (eager graph on CPU)", None,
        lambda ctx, b: _executor(ctx, b, ctx.get_engine())),
    Arm("engine-served", "engine + CUDA graphs, executor as `serve` makes it (every bucket, served context)",
        None, _served_executor),
    Arm("engine-inductor", "engine (P1-P4) through Inductor (mode default: pointwise fusion), then CUDA graphs", "needs CUDA (CUDA graphs)",
        lambda ctx, b: _executor(ctx, b, ctx.get_engine(), compile_decode="default")),
)}
DEFAULT_ARMS = ("eager", "compile-max-autotune", "compile-reduce-overhead", "graphs", "engine")
