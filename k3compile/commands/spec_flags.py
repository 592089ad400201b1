"""The speculative-decoding flags `serve`, `generate` and `bench spec` share (runtime/spec/)."""
from __future__ import annotations


def add_spec_flags(p) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", default=None, choices=["dspark", "ngram"],
                   help="draft with a DSpark drafter (--draft PATH) or by n-gram prompt lookup; verify losslessly")
    g.add_argument("--draft", default=None, help="the DSpark drafter's checkpoint directory")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per request per step (gamma)")
    g.add_argument("--spec-window", default="replay", choices=["replay", "snapshot"],
                   help="KDA rollback: ReplaySSM fold of stored inputs, or a state snapshot per draft position")
    g.add_argument("--spec-plan", default="all", choices=["all", "trim"],
                   help="verify every draft, or trim by confidence against the cost profile (--spec-profile)")
    g.add_argument("--spec-profile", default=None, help="cost profile JSON from `k3compile profile verify`")


def spec_kwargs(args) -> dict:
    """EngineArgs fields for the flags (nothing when --speculative is not given)."""
    from k3compile.model_def.config import ConfigError

    if args.speculative is None:
        if args.draft is not None:
            raise ConfigError("--draft needs --speculative dspark")
        return {}
    if args.speculative == "dspark" and args.draft is None:
        raise ConfigError("--speculative dspark needs --draft PATH")
    if args.spec_plan == "trim" and args.spec_profile is None:
        raise ConfigError("--spec-plan trim needs --spec-profile (k3compile profile verify writes one)")
    return dict(speculative=args.speculative, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                spec_window=args.spec_window, spec_plan=args.spec_plan, spec_profile=args.spec_profile)
