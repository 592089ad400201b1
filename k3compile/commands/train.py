"""k3compile train --out DIR [--model k3-tiny] [--steps N] ...: train a small target on the stdlib corpus."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("train", help="train a small target model (preset shape) on the Python stdlib sources")
    p.add_argument("--out", required=True, help="checkpoint directory to write (config.json + safetensors + curves)")
    p.add_argument("--model", default="k3-tiny", help="preset whose shape and seeded init to start from")
    add_training_args(p)
    p.set_defaults(func=run)


def add_training_args(p) -> None:
    """The flags `train` and `train-draft` share."""
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--corpus-bytes", type=int, default=4 << 20, help="stdlib source bytes to read (tests use less)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1 is fastest on a shared machine, and deterministic)")


def training_run_args(args) -> dict:
    return dict(out=args.out, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                seed=args.seed, eval_every=args.eval_every, corpus_bytes=args.corpus_bytes, device=args.device)


def run(args) -> int:
    import torch

    from k3compile.train.target import TargetRun, train_target
    torch.set_num_threads(args.threads)
    result = train_target(TargetRun(model=args.model, **training_run_args(args)))
    print(json.dumps(result, indent=2))
    return 0
