"""k3compile info --model NAME|PATH [--tp N] [--dtype bf16] [--json]"""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("info", help="parameter counts, weight bytes, KDA state and MLA KV sizes")
    p.add_argument("--model", required=True, help="preset name or checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size for per-rank figures")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from k3compile.info import as_dict, model_info, render
    info = model_info(args.model, args.dtype, args.tp)
    print(json.dumps(as_dict(info), indent=2) if args.json else render(info))
    return 0
