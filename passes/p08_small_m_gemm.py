"""P8 small-M GEMM choice: per GEMM of the decode graph, cuBLAS or a Triton GEMV (split-K "dot" design, or the
"rows" design at up to 4 rows; kernels/gemv.py), by measurement.

Matched (decode graphs only; the weight a constant of a 16-bit dtype the kernel takes):

    mm(x, t(W))              ->  k3.gemv(x, W, None, max_m, block_n, block_k, split_k, design, use_pdl, num_warps
                                          [, l2_prefetch_kb[, early_release[, upper]]]: with those options])

(P11 later folds an add that reads the result into k3.gemv's c. An addmm is left alone: it rounds
once, k3.gemv's c is added after the product is rounded.)

The choice, per node (`choice` option):
* "auto" (default): on a machine with CUDA, time cuBLAS (the node's own aten op) and the GEMV kernel
  (a few block / split-K / warps configurations) at the node's N, K for every decode bucket M <= 16
  (`buckets`); shapes are measured once and shared by the nodes that have them. `timing` says how a
  candidate is timed: "pdl_chain" (default) the way the engine launches it, with use_pdl, so in the timed
  chain over the weight copies each launch and first weight tile overlap the previous GEMV's tail (kda8:
  this reorders the candidates: at the 48B KDA in_proj the rows design with PDL beats cuBLAS, without it it
  loses); "alone" without PDL (the choice before kda8; for A/B). cuBLAS is timed the same way in both.
  The chain is GEMVs back to back, so under "pdl_chain" a GEMV's tail overlaps another GEMV's prologue, while
  in the engine its neighbours are norms / KDA / MoE kernels: an A/B of whole engines (`bench ladder
  --variant p8alone:p08_small_m_gemm.timing=alone`) is the measurement that settles the default.
  The rows design's warps (`rows_warps`) are swept at M = 1 and the best per tile goes on to the larger
  buckets (a full sweep at every bucket would triple the Triton compiles of the build); `rows_programs` lists the
  program counts the rows design's K split aims at (default one, 528: each more count adds its two tiles). Only
  the configurations within `first_bucket_tol` of the fastest at M = 1 compete (small gains above M = 1 are within
  the timing noise and must not outvote a clear M = 1 winner); of those, the one saving the most time summed over
  the buckets it wins wins. The node becomes
  k3.gemv with max_m = the largest bucket up to which the kernel won at every bucket; rows above
  max_m run the aten op inside k3.gemv. If the kernel loses at M = 1 the node stays aten ('cublas').
  With `upper_tier` (off by default), the buckets above that reach choose a second configuration the same way
  among themselves (`upper_min_gain` for the margin over cuBLAS), recorded as k3.gemv's `upper` tier: the op
  launches it for those rows, so a batch-8 step keeps one kernel per GEMM where cuBLAS launched two.
  Without CUDA nothing is measured and every node stays aten.
* "gemv": rewrite every match with max_m = 16 and the default configuration (tests, experiments).
* "cublas": rewrite nothing.

Every decision (node, weight, N, K, choice, max_m, configuration, microseconds per bucket for each)
is recorded in gm.meta["k3"]["pass_details"]["p08_small_m_gemm"], which the pass manager copies into
the pass report (engine.json). Matches = nodes rewritten to k3.gemv. Numerics: where the kernel
does not run, k3.gemv is the same aten call (bit-identical); where it runs, fp32 accumulation with
one rounding (bf16 tolerance).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import attr_tensor, erase_if_dead, fake_mode_of, is_call, replace_uses, set_meta_val, val_of
from .kernels import gemv as gemv_kernels
from .kernels import kda_decode  # noqa: F401  (registers k3::fused_kda_decode, which _feeds_fused_kda looks for)
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
CHOICES = ("auto", "gemv", "cublas")
TIMINGS = ("pdl_chain", "alone")
EARLY_RELEASE = ("none", "all", "except_kda_inputs", "moe_inputs")
_FUSED_KDA = torch.ops.k3.fused_kda_decode.default
_FUSED_MOE = ("k3.fused_moe_decode.default", "k3.fused_moe_decode_norm.default")  # P6's op, P7's with the norm
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
DOT_WARPS = 4
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DESIGN_NAMES = {v: name for name, v in gemv_kernels.DESIGNS.items()}


@dataclass
class SmallMGemmConfig(PassConfig):
    choice: str = "auto"  # auto (measure on CUDA) | gemv (always) | cublas (never)
    buckets: str = "1,2,4,8,16"  # decode batch sizes (M) timed per shape; the kernel's rows are <= 16
    dtypes: str = "bf16,fp16"  # weight dtypes the kernel may take
    modes: str = "decode"  # graphs the pass touches (k3 mode in gm.meta)
    bench_ms: float = 20.0  # bounds the calls per timed CUDA graph (one per weight copy, up to 4 rounds)
    # the kernel must beat cuBLAS by this fraction: near-ties stay cuBLAS, so two builds (the engine and
    # the ladder's in-process rungs) rarely decide a node differently on timing noise
    min_gain: float = 0.03
    # programmatic dependent launch for the kernels it emits (kernels/gemv.py: the first K step's weights load
    # before gdc_wait, dependents launch once x is read)
    use_pdl: bool = True
    timing: str = "pdl_chain"  # pdl_chain (candidates timed with use_pdl, as the engine runs them) | alone (no PDL)
    rows_warps: str = "2,4,8"  # warps per program tried for the rows design (the dot design keeps 4)
    # programs the rows design's K split aims at, one (narrow, wide) tile pair per count ("," or "+" between counts,
    # "+" fits a `bench ladder --variant` string). 528 (4 per H200 SM) gives the 2048-wide GEMVs of k3-mini-6b 1024
    # programs of one K step each; each count adds candidates (a Triton compile per warps). 1, 2 and 4 per SM since
    # session 15 (with P6's latent_prewait and down_early_release; traces/h200_s15: k3-mini-6b batch 1 -7.6%)
    rows_programs: str = "132,264,528"
    # with PDL, each emitted launch asks L2 for up to this many MiB of its weight before its gdc_wait, so a GEMV
    # after a latency-bound kernel (KDA, MLA attention, a norm) streams while that kernel runs (kernels/gemv.py,
    # kernels/l2_prefetch.py); 0: none. Not timed by the measurement above (its chain is GEMVs back to back).
    l2_prefetch_mb: int = 0
    # with PDL, an emitted kernel releases the next one right after its wait, not after its K loop (kernels/gemv.py),
    # so the next kernel loads its weights while the GEMV streams: "none", "all", "except_kda_inputs" (not the
    # GEMVs that feed a fused KDA kernel, whose programs would then hold SMs the GEMV's own programs need; 48B batch 1,
    # traces/h200_s12/call1: "all" made the step 1% slower), or "moe_inputs" (only the GEMVs that feed P6's fused MoE:
    # a latent MoE's front, so that kernel A's programs, with P6's up_prewait, load their expert rows while it streams)
    early_release: str = "none"
    # only configurations within this fraction of the fastest kernel at the first bucket (M = 1) compete; then the
    # time saved over the buckets decides as before; < 0: every configuration competes (the rule before session 13).
    # Why: at 48B the o_proj's dot tile, 1-4% ahead of cuBLAS at M = 2..8 in the GEMV chain but 34% behind the rows
    # tile at M = 1, won the summed savings by 0.4 us in one build and lost them in another; the whole step with it
    # ran 150 us slower at batch 1 and 330 us slower at batch 8 (traces/h200_s13/call1, rung r09 against session
    # 12's), so savings at M > 1 smaller than the timing noise must not outvote a clear M = 1 winner
    first_bucket_tol: float = 0.03
    # a second configuration for the buckets above the first one's reach (k3.gemv's `upper` tier), chosen over those
    # buckets alone by the same rule (most time saved over cuBLAS, from the first bucket above up), with
    # `upper_min_gain` in place of min_gain. Why: the 48B o_proj's and dense down's M = 1 winner (the rows design)
    # stops at M <= 2, so at batch 8 cuBLAS ran them as a split-K GEMM + reduce pair, 28 kernels more per step
    # (traces/h200_s13/call2: 250 kernels at batch 8 against 208 at 1), where a split-K dot tile in one kernel was as
    # fast in the chain timing. Off until the device A/B (tools/gpu_bs8k14.sh)
    upper_tier: bool = False
    # the upper tier's margin over cuBLAS; < 0 lets a kernel within that fraction slower than cuBLAS's timing win:
    # across four H200 builds cuBLAS's own chain timing of the o_proj at M = 8 spread 10.62-11.36 us (7%), and
    # within that noise one PDL launch beats cuBLAS's (a split-K pair at these shapes) on the kernel-count goal
    upper_min_gain: float = -0.03

    def validate(self) -> None:
        if self.choice not in CHOICES:
            raise PassConfigError(f"p08_small_m_gemm.choice must be one of {', '.join(CHOICES)}, got {self.choice!r}")
        buckets = _ints("buckets", self.buckets)
        if not buckets or any(not 1 <= b <= gemv_kernels.MAX_M for b in buckets):
            raise PassConfigError(f"p08_small_m_gemm.buckets must be in 1..{gemv_kernels.MAX_M}, got {self.buckets!r}")
        bad = [d for d in self.dtypes.split(",") if d.strip() and d.strip() not in _DTYPES]
        if bad:
            raise PassConfigError(f"p08_small_m_gemm.dtypes: unknown {bad}; known {', '.join(_DTYPES)}")
        if self.bench_ms <= 0:
            raise PassConfigError("p08_small_m_gemm.bench_ms must be > 0")
        if not 0 <= self.min_gain < 1:
            raise PassConfigError(f"p08_small_m_gemm.min_gain must be in [0, 1), got {self.min_gain}")
        if self.timing not in TIMINGS:
            raise PassConfigError(f"p08_small_m_gemm.timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        if self.early_release not in EARLY_RELEASE:
            raise PassConfigError(f"p08_small_m_gemm.early_release must be one of {', '.join(EARLY_RELEASE)}, "
                                  f"got {self.early_release!r}")
        if self.first_bucket_tol >= 1:
            raise PassConfigError(f"p08_small_m_gemm.first_bucket_tol must be < 1 (< 0: off), "
                                  f"got {self.first_bucket_tol}")
        if not -0.5 <= self.upper_min_gain < 1:
            raise PassConfigError(f"p08_small_m_gemm.upper_min_gain must be in [-0.5, 1), got {self.upper_min_gain}")
        if not 0 <= self.l2_prefetch_mb <= 1024:
            raise PassConfigError(f"p08_small_m_gemm.l2_prefetch_mb must be in 0..1024, got {self.l2_prefetch_mb}")
        programs = _ints("rows_programs", self.rows_programs)
        if not programs or any(not 1 <= p <= 1 << 16 for p in programs):
            raise PassConfigError(f"p08_small_m_gemm.rows_programs must be ints in 1..65536, got {self.rows_programs!r}")
        warps = _ints("rows_warps", self.rows_warps)
        if not warps or any(w not in gemv_kernels.NUM_WARPS for w in warps):
            raise PassConfigError(f"p08_small_m_gemm.rows_warps must be among {gemv_kernels.NUM_WARPS}, "
                                  f"got {self.rows_warps!r}")


def _ints(option: str, text: str) -> list[int]:
    """A comma- (or '+'-) separated option's ints, or PassConfigError naming the option."""
    try:
        return [int(v) for v in text.replace("+", ",").split(",") if v.strip()]
    except ValueError:
        raise PassConfigError(f"p08_small_m_gemm.{option}: expected comma-separated ints, got {text!r}") from None


def _weight_of(node: Node, gm: GraphModule, dtypes) -> Node | None:
    """W when node is t(W) / permute(W, [1, 0]) of a 2-D constant of an allowed dtype."""
    if is_call(node, aten.t.default) or (is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        w = node.args[0]
        if isinstance(w, Node) and w.op == "get_attr":
            t = attr_tensor(gm, w)
            if t.dim() == 2 and t.dtype in dtypes:
                return w
    return None


def _feeds_fused_kda(node: Node, depth: int = 4) -> bool:
    """Whether node's output reaches a fused KDA kernel (P5) through at most `depth` views, splits and their getitems
    (an in-projection's column blocks): nodes that launch no kernel of their own."""
    return _feeds(node, lambda target: target == _FUSED_KDA, depth)


def _feeds_fused_moe(node: Node, depth: int = 4) -> bool:
    """Whether node's output reaches P6's fused MoE op (a latent MoE's front GEMV: z and the shared expert's gate/up
    are its column blocks) through at most `depth` views, splits and their getitems."""
    return _feeds(node, lambda target: str(target) in _FUSED_MOE, depth)


def _feeds(node: Node, is_consumer, depth: int) -> bool:
    frontier = list(node.users)
    for _ in range(depth):
        nxt = []
        for user in frontier:
            if is_consumer(user.target):
                return True
            if user.target is operator.getitem or is_call(user, *_SPLITS) or (
                    isinstance(user.target, torch._ops.OpOverload) and user.target.is_view):
                nxt.extend(user.users)
        frontier = nxt
    return False


def _match(node: Node, gm: GraphModule, dtypes):
    """(x, W) of a GEMM the kernel can take, or None."""
    if not (is_call(node, aten.mm.default) and len(node.args) == 2 and not node.kwargs):
        return None
    x, wt = node.args
    w = _weight_of(wt, gm, dtypes) if isinstance(wt, Node) else None
    xv = val_of(x)
    if w is None or xv is None or xv.dim() != 2 or xv.dtype != attr_tensor(gm, w).dtype:
        return None
    return x, w


# --------------------------------------------------------------------------- measuring (CUDA)

def _candidates(n: int, k: int, sm_count: int, rows_warps=(DOT_WARPS,),
                rows_programs=(gemv_kernels.ROWS_TARGET_PROGRAMS,)):
    """(block_n, block_k, split_k, design, num_warps): three of the dot design (4 warps), the rows design's two
    tiles per program count in rows_programs (duplicates once) at each of rows_warps (each a Triton compile of
    ~1 s per row count: keep the set small)."""
    base = gemv_kernels.default_config(n, k, sm_count)
    dot = gemv_kernels.DESIGNS["dot"]
    out = {(*base, dot, DOT_WARPS), (32, 256, base[2], dot, DOT_WARPS), (64, 128, 1, dot, DOT_WARPS)}
    out |= {(*cfg, w) for p in rows_programs for cfg in gemv_kernels.rows_configs(n, k, p) for w in rows_warps}
    return sorted(out)


def config_label(cfg) -> str:
    """'4x1024x1x1 w8': block_n x block_k x split_k x design, then warps (the labels of traces/h200_s8/kda8.md)."""
    return f"{'x'.join(map(str, cfg[:4]))} w{cfg[4]}"


def _pruned(candidates, first_row: dict) -> list:
    """The candidates timed above the first bucket: of the rows design only the fastest warps per tile at the first
    bucket (`first_row`, its timings; its warps sweep is not repeated at every row count), all the others."""
    rows = gemv_kernels.DESIGNS["rows"]
    best: dict[tuple, tuple] = {}
    for cfg, t in first_row["gemv_us"].items():
        if cfg[3] == rows and (cfg[:4] not in best or t < best[cfg[:4]][0]):
            best[cfg[:4]] = (t, cfg)
    keep = {cfg for _, cfg in best.values()}
    return [c for c in candidates if c[3] != rows or c in keep]


def _measure(w: torch.Tensor, buckets, bench_ms: float, use_pdl: bool = False, rows_warps=(DOT_WARPS,),
             rows_programs=(gemv_kernels.ROWS_TARGET_PROGRAMS,)) -> dict:
    """Microseconds of cuBLAS and of each kernel configuration for each M in buckets, replayed from a CUDA
    graph over enough weight copies that every read comes from HBM (kernels/graph_timing.py says why;
    eager do_bench timed the host launch and made every Triton GEMV lose). bench_ms bounds the calls per graph.
    use_pdl: the kernel's launches in the chain use PDL, as in the engine (cuBLAS's never do)."""
    from .kernels.graph_timing import copies_to_overflow_l2, replay_us

    n, k = w.shape
    dev = torch.device("cuda")
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    copies = copies_to_overflow_l2(w.numel() * w.element_size(), dev)
    w = w.to(dev)
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    gen = torch.Generator(device=dev).manual_seed(0)
    candidates = _candidates(n, k, sm, rows_warps, rows_programs)
    out = {}
    for m in sorted(buckets):
        x = torch.randn(m, k, device=dev, generator=gen).to(w.dtype)
        calls_per_copy = max(1, min(4, int(bench_ms) // copies))

        def bench(run):
            return replay_us([lambda wi=wi: run(wi) for wi in weights] * calls_per_copy)
        row = {"cublas_us": bench(lambda wi: gemv_kernels.gemv_reference(x, wi)), "gemv_us": {}}
        for cfg in _pruned(candidates, out[min(buckets)]) if out else candidates:
            if cfg[3] == gemv_kernels.DESIGNS["rows"] and m > gemv_kernels.ROWS_MAX_M:
                continue  # the rows design stops at ROWS_MAX_M rows: its reach ends there
            try:
                row["gemv_us"][cfg] = bench(lambda wi, cfg=cfg: gemv_kernels.gemv_triton(
                    x, wi, None, cfg[0], cfg[1], cfg[2], num_warps=cfg[4], design=cfg[3], use_pdl=use_pdl))
            except Exception as e:  # a configuration the device cannot run is simply not a candidate
                row.setdefault("errors", {})[config_label(cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
        out[m] = row
    del weights
    return out


def _decide(timings: dict, buckets, min_gain: float = 0.0, first_tol: float = -1.0) -> tuple[int, tuple | None]:
    """(max_m, config): the configuration that saves the most time over cuBLAS summed over the buckets it wins
    from M = 1 up (by more than min_gain; cuBLAS runs above its reach), each bucket weighted alike; ties go to
    the longer reach, then the faster at M = 1. (Reach first, as before session 9, let a tile that barely wins
    at M = 1 and 2 beat one that is 40% faster at M = 1: the 48B o_proj ran 9.0 us where 6.2 was on offer.)
    first_tol >= 0: only the configurations within that fraction of the fastest at the first bucket compete."""
    best = None
    first = min(buckets)
    candidates = {c for row in timings.values() for c in row["gemv_us"]}
    if first_tol >= 0 and timings[first]["gemv_us"]:
        fastest = min(timings[first]["gemv_us"].values())
        candidates = {c for c in candidates
                      if timings[first]["gemv_us"].get(c, float("inf")) <= fastest * (1 + first_tol)}
    for cfg in candidates:
        reach, saved = 0, 0.0
        for m in sorted(buckets):
            t = timings[m]["gemv_us"].get(cfg)
            if t is None or t >= (1.0 - min_gain) * timings[m]["cublas_us"]:
                break
            reach, saved = m, saved + timings[m]["cublas_us"] - t
        score = (saved, reach, -timings[first]["gemv_us"].get(cfg, float("inf")))
        if reach and (best is None or score > best[0]):
            best = (score, cfg)
    return (0, None) if best is None else (best[0][1], best[1])


def _decide_upper(timings: dict, buckets, max_m: int, min_gain: float) -> tuple[int, tuple | None]:
    """(reach, config) of the upper tier above the first configuration's reach max_m: `_decide` over the buckets
    above it alone (from the first of them up; min_gain < 0 admits a kernel that much slower than cuBLAS), (0, None)
    where there is no first configuration, no bucket above it, or no configuration wins the first bucket above."""
    above = [m for m in sorted(buckets) if m > max_m]
    if not max_m or not above:
        return 0, None
    return _decide({m: timings[m] for m in above}, above, min_gain)


def _decide_tiers(timings: dict, buckets, config: SmallMGemmConfig) -> tuple[int, tuple | None, list[tuple]]:
    """(max_m, config, upper tiers) of one GEMM from its timings under the pass's options: `_decide`, then with
    upper_tier `_decide_upper` above its reach (the same configuration again just extends the reach)."""
    max_m, cfg = _decide(timings, buckets, config.min_gain, config.first_bucket_tol)
    if not config.upper_tier:
        return max_m, cfg, []
    up_m, up_cfg = _decide_upper(timings, buckets, max_m, config.upper_min_gain)
    if up_m and up_cfg == cfg:  # the first configuration, admitted above by upper_min_gain: one tier, longer
        return up_m, cfg, []
    return max_m, cfg, [(up_m, *up_cfg)] if up_m else []


# Timings per (device, shape, dtype, timing options), kept for the process: the nodes of one graph share a
# shape's measurement, and so do later builds in the same process (bench ladder's rungs and --variant arms, which
# would otherwise re-time the same GEMVs for ~20 s each). A build in a new process measures afresh.
_MEASURED: dict[tuple, dict] = {}


# --------------------------------------------------------------------------- the pass

@register_pass("p08_small_m_gemm", SmallMGemmConfig)
def small_m_gemm(gm: GraphModule, config: SmallMGemmConfig) -> int:
    """Small-M GEMMs: cuBLAS or the Triton split-K GEMV per shape, measured at build time."""
    config.validate()
    meta = gm.meta.setdefault("k3", {})
    details = {"choice": config.choice, "measured_on": None, "use_pdl": bool(config.use_pdl),
               "timing": config.timing, "nodes": []}
    meta.setdefault("pass_details", {})["p08_small_m_gemm"] = details
    modes = {m.strip() for m in config.modes.split(",") if m.strip()}
    if meta.get("mode", "decode") not in modes or config.choice == "cublas":
        return 0
    dtypes = tuple(_DTYPES[d.strip()] for d in config.dtypes.split(",") if d.strip())
    buckets = sorted(set(_ints("buckets", config.buckets)))
    measure = config.choice == "auto" and torch.cuda.is_available()
    timed_pdl = config.timing == "pdl_chain" and bool(config.use_pdl)
    rows_warps = tuple(_ints("rows_warps", config.rows_warps))
    rows_programs = tuple(sorted(set(_ints("rows_programs", config.rows_programs))))
    if measure:
        details["measured_on"] = torch.cuda.get_device_name()
    matches = [(n, m) for n in list(gm.graph.nodes) if (m := _match(n, gm, dtypes)) is not None]
    fake_mode = fake_mode_of(gm) if matches else None
    count = 0
    for node, (x, w) in matches:
        weight = attr_tensor(gm, w)
        n, k = weight.shape
        rec = {"node": node.name, "op": str(node.target), "weight": w.target, "N": n, "K": k,
               "dtype": str(weight.dtype).removeprefix("torch.")}
        upper = []  # upper tiers: (max_m, block_n, block_k, split_k, design, num_warps)
        if config.choice == "gemv":
            max_m, cfg = gemv_kernels.MAX_M, (*gemv_kernels.default_config(n, k), gemv_kernels.DESIGNS["dot"], DOT_WARPS)
        elif measure:
            key = (details["measured_on"], n, k, weight.dtype, tuple(buckets), config.bench_ms, config.timing,
                   bool(config.use_pdl), rows_warps, rows_programs)
            rec["measured_earlier"] = key in _MEASURED
            if key not in _MEASURED:
                _MEASURED[key] = _measure(weight, buckets, config.bench_ms, timed_pdl, rows_warps, rows_programs)
            timings = _MEASURED[key]
            max_m, cfg, upper = _decide_tiers(timings, buckets, config)
            rec["us"] = {str(m): {"cublas": round(t["cublas_us"], 2),
                                  "gemv": {config_label(c_): round(v, 2) for c_, v in t["gemv_us"].items()}}
                         for m, t in timings.items()}
        else:
            max_m, cfg = 0, None
        rec["choice"] = "gemv" if max_m else "cublas"
        rec["max_m"] = max_m
        rec["config"] = None if cfg is None else {"block_n": cfg[0], "block_k": cfg[1], "split_k": cfg[2],
                                                  "design": _DESIGN_NAMES[cfg[3]], "num_warps": cfg[4]}
        if upper:
            rec["upper"] = [{"max_m": row[0], "block_n": row[1], "block_k": row[2], "split_k": row[3],
                             "design": _DESIGN_NAMES[row[4]], "num_warps": row[5]} for row in upper]
        details["nodes"].append(rec)
        if not max_m:
            continue
        args = (x, w, None, max_m, *cfg[:4], bool(config.use_pdl), cfg[4])
        early = bool(config.use_pdl) and (config.early_release == "all" or config.early_release == "except_kda_inputs"
                                          and not _feeds_fused_kda(node)
                                          or config.early_release == "moe_inputs" and _feeds_fused_moe(node))
        if config.use_pdl and (config.l2_prefetch_mb or early):  # (without either: as before the options existed)
            args += (int(config.l2_prefetch_mb) << 10,)
            rec["l2_prefetch_kb"] = args[-1]
        if early:
            args += (True,)
            rec["early_release"] = True
        if upper:  # positional after l2_prefetch_kb and early_release (their defaults where not set above)
            args += (0, False)[len(args) - 10:] + (gemv_kernels.flat_upper(upper),)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.k3.gemv.default, args)
        set_meta_val(new, fake_mode)
        replace_uses(node, new, fake_mode)
        wt = node.args[-1]
        gm.graph.erase_node(node)
        erase_if_dead(gm, [wt])
        count += 1
    return count
