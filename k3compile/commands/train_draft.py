"""k3compile train-draft --target DIR --out DIR [--steps N] ...: distill a DSpark drafter from a target,
then measure its greedy acceptance (mean committed tokens per verify) at several gammas."""
from __future__ import annotations

import json
import os

from k3compile.commands.train import add_training_args, training_run_args


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def register(sub) -> None:
    p = sub.add_parser("train-draft", help="distill a DSpark block drafter from a trained target (DSpark losses)")
    p.add_argument("--target", required=True, help="target checkpoint directory (e.g. from `k3compile train`)")
    p.add_argument("--out", required=True, help="drafter checkpoint directory to write")
    p.add_argument("--anchors", type=int, default=16, help="blocks per training sequence")
    p.add_argument("--block-size", type=int, default=8, help="gamma the drafter is trained for (max proposal)")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    p.add_argument("--target-layers", type=_ints, default=None,
                   help="comma-separated target layers to read features from (default: 3 spread layers)")
    p.add_argument("--accept-gammas", type=_ints, default=(4, 6, 8),
                   help="gammas at which to measure greedy acceptance after training (empty: skip)")
    p.add_argument("--accept-prompts", type=int, default=8)
    p.add_argument("--accept-tokens", type=int, default=64, help="new tokens per prompt in the acceptance run")
    p.add_argument("--accept-prompt-len", type=int, default=64, help="prompt tokens (validation crops)")
    add_training_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from k3compile.train.draft import DraftRun, train_drafter
    torch.set_num_threads(args.threads)
    result = train_drafter(DraftRun(target=args.target, anchors=args.anchors, block_size=args.block_size,
                                    layers=args.layers, target_layer_ids=args.target_layers,
                                    **training_run_args(args)))
    print(json.dumps(result, indent=2))
    if args.accept_gammas:
        from k3compile.train.acceptance import measure_acceptance
        acc = measure_acceptance(args.target, args.out, args.accept_gammas, args.accept_prompts,
                                 args.accept_tokens, args.accept_prompt_len, seed=args.seed, device=args.device,
                                 corpus_bytes=args.corpus_bytes)
        with open(os.path.join(args.out, "acceptance.json"), "w") as f:
            json.dump(acc, f, indent=2)
        print(json.dumps(acc, indent=2))
    return 0
