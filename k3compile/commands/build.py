"""k3compile build --model NAME|PATH --topology single [pass flags] [--dtype bf16] [--device cuda] -o DIR"""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("build", help="compile a model into an engine directory (capture -> passes -> emit)")
    p.add_argument("--model", required=True, help="preset name or checkpoint directory")
    p.add_argument("--topology", default="single",
                   help="parallel layout: single, tpN, tepN, dcpM or tpN-dcpM (one engine per rank under DIR/rank{r})")
    p.add_argument("-o", "--output", required=True, help="engine directory to write")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--device", default="cpu", help="where to load the model and run the passes (cpu, cuda)")
    p.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--page-size", type=int, default=16, help="KV page size the runtime will use with this engine")
    add_pipeline_args(p)
    p.add_argument("--verify", action="store_true", help="check every pass's output against its input graph")
    p.add_argument("--verify-graphs", action="store_true",
                   help="also build the speculative-decoding verify step (needed by serve --speculative on an engine)")
    p.add_argument("--dump-graphs", action="store_true", help="write the graph after each pass under DIR/dumps/")
    p.add_argument("--overwrite", action="store_true", help="replace an existing engine directory")
    p.set_defaults(func=run)
    return p


def add_pipeline_args(p) -> None:
    """The pass-pipeline flags (the pass manager owns them; shared with `k3compile bench`)."""
    from k3compile.passes.pipeline import add_pass_arguments

    add_pass_arguments(p)  # --pass-config FILE, --passes, --disable-pass, --enable-pass, --pass-opt
    p.add_argument("--pipeline", dest="pass_config", metavar="FILE", help="same as --pass-config")


def pipeline_from_args(args):
    """The PipelineConfig the flags describe (registry defaults < file < --passes < enable/disable < opts)."""
    from k3compile.passes.pipeline import pipeline_from_args as parse

    return parse(args)


def run(args) -> int:
    from k3compile.engine.build import BuildOptions, build_engine
    from k3compile.info import DTYPES

    if args.page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {args.page_size}")
    opts = BuildOptions(model=args.model, dtype=DTYPES[args.dtype], device=args.device, topology=args.topology,
                        page_size=args.page_size, seed=args.seed, pipeline=pipeline_from_args(args),
                        verify=args.verify, verify_graphs=args.verify_graphs, dump_graphs=args.dump_graphs,
                        overwrite=args.overwrite)
    build_engine(opts, args.output)
    return 0
