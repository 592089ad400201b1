"""Build a parallel engine: one complete engine per rank under DIR/rank{r}/, and DIR/engine.json naming them.

The whole model is partitioned before capture: `shard_model` cuts each rank's module tree out of it
(heads, columns, experts, vocabulary, with k3:: collectives where partial results meet), then each
rank's steps are captured and the single-GPU pass pipeline runs on them unchanged. The plan (which
rank holds which heads, experts and KV positions, with sizes) goes into every manifest.
"""
from __future__ import annotations

import os
import time

from k3compile.capture import MODES
from k3compile.model_def.config import ConfigError
from k3compile.model_def.parallel.plan import all_rank_plans
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, Topology

from . import format as fmt
from .emit import write_engine
from .engine import DTYPE_NAMES, Engine


def rank_dir(rank: int) -> str:
    return f"rank{rank}"


def build_ranks(opts, topology: Topology, model, stage, tok_src, log, t0) -> Engine:
    from k3compile.engine.build import _pipeline_dict, compile_graphs
    from k3compile.plan import plans_as_dict

    if opts.verify:
        raise ConfigError("--verify runs every pass's graphs, and a rank's graphs need all ranks running; build "
                          f"{topology.name} without --verify (the gloo tests check rank graphs against one process)")
    cfg = model.config
    plan = plans_as_dict(all_rank_plans(cfg, topology, opts.dtype))
    mode = RankShard.of(cfg, topology, 0).expert_mode
    source = os.path.abspath(opts.model) if os.path.isdir(opts.model) else opts.model
    first = None
    for r in range(topology.world):
        log(f"rank {r}/{topology.world}: partitioning ({topology.name}, experts {mode})")
        rank_model = shard_model(model, RankShard.of(cfg, topology, r))
        out = os.path.join(stage.dir, rank_dir(r))
        os.makedirs(out)
        dump_root = os.path.join(out, fmt.DUMPS_DIR) if opts.dump_graphs else None
        modes = MODES + (("verify",) if opts.verify_graphs else ())  # verify steps run under DCP too
        graphs, reports = compile_graphs(rank_model, opts.pipeline, modes, False, dump_root, log)
        for rec in (x for rep in reports.values() for x in rep.get("passes", [])):
            if rec.get("dump"):
                rec["dump"] = os.path.relpath(rec["dump"], out).replace(os.sep, "/")
        engine = Engine(cfg, graphs, opts.dtype, page_size=opts.page_size, topology=topology, rank=r)
        build = {"device": str(opts.device), "seed": opts.seed, "verify": False,
                 "pipeline": _pipeline_dict(opts.pipeline), "seconds": round(time.perf_counter() - t0, 3)}
        parallel = {"topology": topology.name, "experts": topology.experts, "expert_mode": mode, "rank": r,
                    "world": topology.world, "plan": plan}
        engine.manifest = write_engine(out, engine, source, reports, build, tok_src, parallel)
        first = first or engine
        del rank_model
    top = {"format_version": fmt.FORMAT_VERSION, "model": first.manifest["model"], "dtype": DTYPE_NAMES[opts.dtype],
           "topology": topology.name, "experts": topology.experts, "expert_mode": mode, "world": topology.world,
           "page_size": opts.page_size,
           "decode_buckets": list(first.decode_buckets), "graphs": sorted(first.graphs),
           "ranks": {str(r): rank_dir(r) for r in range(topology.world)}, "plan": plan, "files": {}}
    fmt.write_json(os.path.join(stage.dir, fmt.MANIFEST), top)
    return first
