"""k3compile generate (--model NAME|PATH | --engine DIR) --prompt TEXT --max-new-tokens N [sampling flags]

A parallel engine (built with --topology), or a model with --topology, runs on all its ranks (one
process each, started here) through the runtime's LLMEngine, rank 0 printing the text."""
from __future__ import annotations

import sys

from .spec_flags import add_spec_flags, spec_kwargs


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (prefill + decode)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="preset name or checkpoint directory")
    src.add_argument("--engine", help="engine directory written by `k3compile build`")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and preset weight seed with --model)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="model weights dtype (default fp32); an engine has the dtype it was built with")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk size")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's tokenizer code")
    p.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    p.add_argument("--topology", default=None, help="a model only: run it on tpN / dcpM / tpN-dcpM / tepN ranks")
    add_spec_flags(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from k3compile.generate import generate_ids
    from k3compile.model_def.config import ConfigError
    from k3compile.model_def.dtypes import DTYPES
    from k3compile.model_def.loader import load_model
    from k3compile.runtime.sampling import SamplingParams
    from k3compile.tokenizer import load_tokenizer

    try:   # bad sampling flags: one line before anything is loaded
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
    except ValueError as e:
        raise ConfigError(str(e).replace("max_new_tokens", "--max-new-tokens")) from None
    spec = spec_kwargs(args)
    page_size = 16
    if _parallel(args):
        return _run_parallel(args, params)
    if args.engine is not None:
        from k3compile.engine import open_engine

        opened = open_engine(args.engine, device=args.device, trust_remote_code=args.trust_remote_code)
        if args.dtype is not None and args.dtype != opened.dtype:
            raise ConfigError(f"--dtype {args.dtype}: engine {args.engine} was built for {opened.dtype} "
                              f"(rebuild it to change)")
        if opened.tokenizer is None:
            raise ConfigError(f"engine {args.engine} has no tokenizer (no tokenizer/ folder and a vocabulary "
                              f"too small for bytes)")
        model, tok, page_size = opened.engine, opened.tokenizer, opened.page_size
    else:
        model = load_model(args.model, dtype=DTYPES[args.dtype or "fp32"], device=args.device, seed=args.seed)
        tok = load_tokenizer(args.model, model.config, args.trust_remote_code)
    prompt = tok.encode(args.prompt)
    try:
        ids = generate_ids(model, prompt, params, page_size=page_size, chunk_size=args.chunk_size,
                           eos_token_id=tok.eos_token_id, speculation=spec)
    except ValueError as e:   # the prompt does not fit the context, ...
        raise ConfigError(str(e)) from None
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    if args.show_ids:
        print("ids:", " ".join(map(str, ids)))
    return 0


def _parallel(args) -> bool:
    if getattr(args, "topology", None) not in (None, "single"):
        return True
    if args.engine is None:
        return False
    from k3compile.engine import format as fmt
    return "ranks" in fmt.read_manifest(args.engine)


def _run_parallel(args, params) -> int:
    from k3compile.model_def.config import ConfigError
    from k3compile.runtime.engine import EngineArgs, LLMEngine

    if spec_kwargs(args).get("speculative"):
        raise ConfigError("speculative decoding is not supported on a parallel engine yet")
    from .serve import torchrun_worker

    eargs = EngineArgs(model=args.model, engine_dir=args.engine, topology=args.topology, device=args.device,
                       dtype=args.dtype, seed=args.seed, chunk_size=args.chunk_size)
    code = torchrun_worker(eargs)  # under torchrun, ranks 1.. execute rank 0's steps and print nothing
    if code is not None:
        return code
    try:
        engine = LLMEngine(eargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        tok = engine.tokenizer
        if tok is None:
            raise ConfigError("this model has no tokenizer (token ids only)")
        try:
            ids = engine.generate([tok.encode(args.prompt)], params)[0]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    finally:
        engine.close()
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    if args.show_ids:
        print("ids:", " ".join(map(str, ids)))
    return 0
