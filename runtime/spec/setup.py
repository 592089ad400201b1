"""Build the engine's speculative decoder from EngineArgs: the proposer, the planner, the draft window."""
from __future__ import annotations

from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, check_layout

from .cost_profile import CostProfile
from .ngram import NgramProposer
from .planner import Planner
from .spec_decode import SpecDecoder

WINDOW_KINDS = ("replay", "snapshot")
PROPOSERS = ("ngram", "dspark")


def make_proposer(name: str, draft: str | None, gamma: int, target, device: str):
    if name == "ngram":
        return NgramProposer(gamma=gamma)
    if name == "dspark":
        if draft is None:
            raise ValueError("--speculative dspark needs --draft PATH (a drafter checkpoint directory)")
        try:
            from . import dspark_proposer
        except ImportError as e:
            raise ValueError(f"--speculative dspark: the DSpark proposer is not available here ({e})") from e
        return dspark_proposer.DSparkProposer.from_checkpoint(draft, target, gamma=gamma)
    raise ValueError(f"unknown speculative method {name!r}; expected one of {', '.join(PROPOSERS)}")


def kda_launch_layout(manifest: dict | None) -> str:
    """The KDA launch layout an engine's P5 kernels were built with (its manifest's build pipeline), which the
    fold must follow; DEFAULT_LAYOUT without an engine or for one built before P5 had the option. A name
    that is no layout (an engine built with one since dropped) is refused here, before any step runs."""
    pipeline = ((manifest or {}).get("build") or {}).get("pipeline") or {}
    p5 = (pipeline.get("passes") or {}).get("p05_fused_kda_decode") or {}
    return check_layout(p5.get("launch", DEFAULT_LAYOUT))


def make_spec_decoder(args, target, cache_spec, max_running: int, device: str, proposer=None,
                      window_rows: int | None = None, padded: bool = False,
                      kda_launch: str = DEFAULT_LAYOUT) -> SpecDecoder:
    """`window_rows`: draft-window rows (>= the largest verify batch, padding included); `padded`: verify
    steps run padded to buckets (CUDA graphs), so a step costs what its longest request costs; `kda_launch`:
    P5's launch layout in the graphs (`kda_launch_layout` of the engine's manifest)."""
    if args.spec_window not in WINDOW_KINDS:
        raise ValueError(f"spec_window must be one of {WINDOW_KINDS}, got {args.spec_window!r}")
    if args.num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {args.num_speculative_tokens}")
    if proposer is None:
        proposer = make_proposer(args.speculative, args.draft, args.num_speculative_tokens, target, device)
    profile = CostProfile.load(args.spec_profile) if args.spec_profile else None
    planner = Planner(args.spec_plan, profile, padded=padded)
    return SpecDecoder(proposer, planner, args.spec_window, cache_spec, window_rows or max_running, device,
                       kda_launch=kda_launch)
