"""k3compile profile verify (--engine DIR | --model NAME): the verify-step cost surface (k3compile/bench/spec_profile.py)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("profile", help="measured cost profiles the runtime reads (profiles/)")
    kinds = p.add_subparsers(dest="profile", metavar="PROFILE")
    kinds.required = True
    v = kinds.add_parser("verify", help="verify-step time per (batch size, verify tokens per request)")
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", help="engine directory built with --verify-graphs")
    src.add_argument("--model", help="preset or checkpoint directory (eager model)")
    v.add_argument("--batch", default="1,2,4,8,16,32,64,128,256", help="batch sizes (buckets)")
    v.add_argument("--tokens", type=int, default=8, help="largest verify tokens per request (gamma + 1)")
    v.add_argument("--context", type=int, default=1024, help="context length of every request")
    v.add_argument("--steps", type=int, default=20, help="timed steps per point")
    v.add_argument("--warmup", type=int, default=3)
    v.add_argument("--window", default="replay", choices=["replay", "snapshot"])
    v.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="--model only (default fp32)")
    v.add_argument("--device", default="cpu")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--out", default="profiles", help="output folder")
    v.set_defaults(func=run)
    return p


def run(args) -> int:
    from k3compile.bench import spec_profile
    from k3compile.model_def.config import ConfigError
    from k3compile.model_def.dtypes import DTYPES

    try:
        batches = sorted({int(x) for x in args.batch.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--batch must be comma-separated integers, got {args.batch!r}") from None
    if not batches or batches[0] < 1 or args.tokens < 1 or args.context < 1 or args.steps < 1:
        raise ConfigError("--batch, --tokens, --context and --steps must be positive")
    page_size = 16
    if args.engine is not None:
        from k3compile.engine import open_engine

        provider = open_engine(args.engine, device=args.device).engine
        page_size = provider.page_size
        if "verify" not in provider.graphs and args.window == "replay":
            raise ConfigError(f"engine {args.engine} has no verify step: rebuild it with --verify-graphs")
    else:
        from k3compile.model_def.loader import load_model
        provider = load_model(args.model, dtype=DTYPES[args.dtype or "fp32"], device=args.device, seed=args.seed,
                              progress=False)
    prof = spec_profile.measure(provider, batches, args.tokens, args.context, args.steps, args.warmup, page_size,
                                args.window, seed=args.seed)
    path = spec_profile.write(prof, args.out)
    print(spec_profile.markdown(prof))
    print(f"wrote {path} (+ .md, .png)")
    return 0
