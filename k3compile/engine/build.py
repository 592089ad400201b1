"""The build pipeline: load the model, capture the steps, run the pass pipeline, emit the engine.

    engine = build_engine(BuildOptions(model="k3-tiny", dtype=torch.float32), "engines/tiny")

`compile_graphs` is the in-memory part (capture + passes), shared with `k3compile bench`, which
times a pipeline without writing it to disk. Progress goes to `log` (stderr for the CLI).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.fx

from k3compile.capture import MODES, capture_step

from . import format as fmt
from .emit import StagedDir, write_engine
from .engine import DTYPE_NAMES, Engine



@dataclass
class BuildOptions:
    model: str  # preset name or checkpoint directory
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    topology: str = "single"
    page_size: int = 16  # the runtime page size the engine is built for (graphs work with any)
    seed: int = 0  # preset weight seed
    pipeline: object | None = None  # a passes.pipeline.PipelineConfig; None runs no passes
    verify: bool = False
    verify_graphs: bool = False  # also capture the speculative-decoding verify step (ReplaySSM window)
    dump_graphs: bool = False
    overwrite: bool = False


class Progress:
    """`[  1.2s] message` lines, timed from construction."""

    def __init__(self, stream=None):
        self.stream, self.t0 = stream if stream is not None else sys.stderr, time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)


def run_pipeline(gm: torch.fx.GraphModule, pipeline, mode: str, example_inputs=None, verify: bool = False,
                 dump_dir: str | None = None) -> dict:
    """Run the pass pipeline on `gm` in place; returns the pass manager's report as a dict.
    No pipeline: the graph stays as captured and the report lists no passes."""
    if pipeline is None:
        return {"graph": mode, "passes": []}
    from k3compile.passes.manager import PassManager

    report = PassManager(pipeline, verify=verify, dump_dir=dump_dir).run(gm, example_inputs=example_inputs,
                                                                         graph_name=mode)
    return report.to_dict()


def compile_graphs(model, pipeline=None, modes=MODES, verify: bool = False, dump_root: str | None = None,
                   log=None) -> tuple[dict[str, torch.fx.GraphModule], dict]:
    """Capture each step of `model` and run the pipeline on it: ({mode: graph}, {mode: pass report})."""
    from .report import pass_rows

    log = log or (lambda msg: None)
    graphs, reports = {}, {}
    for mode in modes:
        log(f"capturing the {mode} step")
        gm = capture_step(model, mode)
        log(f"  {mode}: {len(gm.graph.nodes)} nodes")
        dump = os.path.join(dump_root, mode) if dump_root else None
        if dump:
            os.makedirs(dump, exist_ok=True)
        if pipeline is not None:
            log(f"running passes on the {mode} graph" + (" (verifying each)" if verify else ""))
        inputs = None
        if verify and pipeline is not None and mode in MODES:  # verify steps: passes run, unchecked
            from k3compile.passes.verify import step_inputs
            inputs = step_inputs(model, mode)
        report = run_pipeline(gm, pipeline, mode, inputs, verify, dump)
        for r in pass_rows(report):
            err = r.get("max_rel_err")
            log(f"  {mode}: {r.get('name')}: {r.get('matches')} matches, nodes {r.get('nodes_before')} -> "
                f"{r.get('nodes_after')}, launches {r.get('launches_before')} -> {r.get('launches_after')}, "
                f"{r.get('seconds', 0) or 0:.2f}s" + (f", verified (max rel err {err:.1e})" if err is not None else ""))
        graphs[mode], reports[mode] = gm, report
    return graphs, reports


def build_engine(opts: BuildOptions, out_dir: str, log=None) -> Engine:
    """Build and write an engine directory; returns the in-memory engine (same graphs as written)."""
    from k3compile.model_def.config import ConfigError
    from k3compile.model_def.loader import load_model
    from k3compile.tokenizer import _TOKENIZER_FILES

    from k3compile.model_def.parallel.topology import parse_topology

    topology = parse_topology(opts.topology)
    if opts.dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype {opts.dtype} is not supported (fp32, bf16, fp16)")
    log = log or Progress()
    t0 = time.perf_counter()
    stage = StagedDir(out_dir, overwrite=opts.overwrite)
    try:
        log(f"loading {opts.model} ({DTYPE_NAMES[opts.dtype]}, {opts.device})")
        model = load_model(opts.model, dtype=opts.dtype, device=opts.device, seed=opts.seed, progress=False)
        tok_src = opts.model if os.path.isdir(opts.model) and any(
            os.path.isfile(os.path.join(opts.model, f)) for f in _TOKENIZER_FILES) else None
        if topology.world > 1:
            from .build_parallel import build_ranks
            engine = build_ranks(opts, topology, model, stage, tok_src, log, t0)
            engine.path = stage.commit()
            log(f"done: {out_dir} ({topology.world} ranks, {time.perf_counter() - t0:.1f}s)")
            return engine
        dump_root = os.path.join(stage.dir, fmt.DUMPS_DIR) if opts.dump_graphs else None
        modes = MODES + (("verify",) if opts.verify_graphs else ())
        graphs, reports = compile_graphs(model, opts.pipeline, modes, opts.verify, dump_root, log)
        for rec in (r for rep in reports.values() for r in rep.get("passes", [])):
            if rec.get("dump"):  # paths inside the engine, not the staging directory
                rec["dump"] = os.path.relpath(rec["dump"], stage.dir).replace(os.sep, "/")
        engine = Engine(model.config, graphs, opts.dtype, page_size=opts.page_size)
        log(f"saving the engine to {out_dir}")
        build = {"device": str(opts.device), "seed": opts.seed, "verify": opts.verify,
                 "pipeline": _pipeline_dict(opts.pipeline), "seconds": round(time.perf_counter() - t0, 3)}
        source = os.path.abspath(opts.model) if os.path.isdir(opts.model) else opts.model
        manifest = write_engine(stage.dir, engine, source, reports, build, tok_src)
        engine.manifest, engine.path = manifest, stage.commit()
    except BaseException:
        stage.abort()
        raise
    log(f"done: {out_dir} ({manifest['weights']['bytes'] / 1e6:.1f} MB of weights, "
        f"{time.perf_counter() - t0:.1f}s)")
    return engine


def _pipeline_dict(pipeline):
    """The pipeline asked for, as JSON (the pass reports say what it did)."""
    return None if pipeline is None else pipeline.to_dict()
