"""k3compile info --model NAME|PATH [--tp N] [--dtype bf16] [--json]"""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("info", help="parameter counts, weight bytes, KDA state and MLA KV sizes")
    p.add_argument("--model", required=True, help="preset name or checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size for per-rank figures")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--topology", default=None,
                   help="print the per-rank view of a parallel layout (tpN, tepN, dcpM, tpN-dcpM)")
    p.add_argument("--experts", default="auto", choices=["auto", "tp", "ep"], help="routed-expert placement")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.topology is not None:
        return run_topology(args)
    from k3compile.info import as_dict, model_info, render
    info = model_info(args.model, args.dtype, args.tp)
    print(json.dumps(as_dict(info), indent=2) if args.json else render(info))
    return 0


def run_topology(args) -> int:
    from k3compile.info import DTYPES
    from k3compile.model_def.loader import resolve_config
    from k3compile.model_def.parallel.plan import all_rank_plans
    from k3compile.model_def.parallel.topology import parse_topology
    from k3compile.plan import plans_as_dict, render_ranks

    cfg, topo = resolve_config(args.model), parse_topology(args.topology, args.experts)
    if args.json:
        print(json.dumps({"topology": topo.name, "ranks": plans_as_dict(all_rank_plans(cfg, topo, DTYPES[args.dtype]))},
                         indent=2))
    else:
        print(render_ranks(cfg, topo, DTYPES[args.dtype]))
    return 0
