"""k3compile generate --model NAME|PATH --prompt TEXT --max-new-tokens N [sampling flags]"""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (prefill + decode)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="preset name or checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and preset weight seed)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
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

    model = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, seed=args.seed)
    tok = load_tokenizer(args.model, model.config, args.trust_remote_code)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    prompt = tok.encode(args.prompt)
    ids = generate_ids(model, prompt, params, chunk_size=args.chunk_size, eos_token_id=tok.eos_token_id)
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    if args.show_ids:
        print("ids:", " ".join(map(str, ids)))
    return 0
