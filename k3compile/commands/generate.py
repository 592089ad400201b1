"""k3compile generate (--model NAME|PATH | --engine DIR) --prompt TEXT --max-new-tokens N [sampling flags]"""
from __future__ import annotations

import os
import sys


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
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from k3compile.generate import generate_ids
    from k3compile.info import DTYPES
    from k3compile.model_def.loader import load_model
    from k3compile.runtime.sampling import SamplingParams
    from k3compile.tokenizer import load_tokenizer

    if args.engine is not None:
        model, tok_path = _load_engine(args)
    else:
        model = load_model(args.model, dtype=DTYPES[args.dtype or "fp32"], device=args.device, seed=args.seed)
        tok_path = args.model
    tok = load_tokenizer(tok_path, model.config, args.trust_remote_code)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    prompt = tok.encode(args.prompt)
    ids = generate_ids(model, prompt, params, chunk_size=args.chunk_size, eos_token_id=tok.eos_token_id)
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    if args.show_ids:
        print("ids:", " ".join(map(str, ids)))
    return 0


def _load_engine(args):
    """The engine and where its tokenizer is (its tokenizer/ folder, or the byte tokenizer's config)."""
    from k3compile.engine import Engine
    from k3compile.engine.engine import DTYPE_NAMES
    from k3compile.engine.format import TOKENIZER_DIR
    from k3compile.model_def.config import ConfigError

    engine = Engine.load(args.engine, device=args.device)
    built = DTYPE_NAMES[engine.dtype]
    if args.dtype is not None and args.dtype != built:
        raise ConfigError(f"--dtype {args.dtype}: engine {args.engine} was built for {built} (rebuild it to change)")
    tok_dir = os.path.join(args.engine, TOKENIZER_DIR)
    return engine, tok_dir if os.path.isdir(tok_dir) else args.engine
