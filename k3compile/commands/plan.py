"""k3compile plan --model NAME|PATH --gpus N --gpu-memory 141GB [--expert-quant config|mxfp4|none]"""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-rank memory, KV capacity and communication for TP, TEP, DCP and TP x DCP")
    p.add_argument("--model", required=True, help="preset name or checkpoint directory")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory", required=True, help="memory of one GPU, e.g. 141GB or 80GiB")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="share of GPU memory for weights + KV + KDA state (default: the runtime's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--expert-quant", default="config", choices=["config", "mxfp4", "none"],
                   help="routed-expert storage: as the config says, MXFP4 (the K3 checkpoint's), or the model dtype")
    p.set_defaults(func=run)


def plan_config(model: str, expert_quant: str):
    from k3compile.model_def.loader import resolve_config
    cfg = resolve_config(model)
    return cfg if expert_quant == "config" else cfg.replace(expert_quant=None if expert_quant == "none" else "mxfp4")


def run(args) -> int:
    from k3compile.info import DTYPES
    from k3compile.plan import parse_bytes, render_plan
    from k3compile.runtime.memory.sizing import DEFAULT_MEM_FRACTION_STATIC, check_fraction

    fraction = check_fraction(DEFAULT_MEM_FRACTION_STATIC if args.mem_fraction is None else args.mem_fraction)
    print(render_plan(plan_config(args.model, args.expert_quant), args.gpus, parse_bytes(args.gpu_memory), fraction,
                      DTYPES[args.dtype]))
    return 0
