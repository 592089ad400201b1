"""LLMEngine: model + memory + hybrid radix cache + scheduler + runner, driven one step at a time.

    engine = LLMEngine(EngineArgs(model="k3-tiny"))
    engine.add_request("r1", prompt_ids, SamplingParams(max_new_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():           # RequestOutput: new tokens, finished, finish_reason
            ...
    engine.generate([ids_a, ids_b], SamplingParams(max_new_tokens=8))   # offline convenience

Memory. A byte budget (`memory_bytes`; without it sized from the device after the weights are
loaded, `mem_fraction_static`, runtime/memory/sizing.py) becomes one arena KV pages and KDA state
slots share (the default) or, with `enable_unified_memory=False` or a `state_fraction`, split pools
(`state_fraction` of it for state slots, the rest KV pages: SGLang's layout). The arena is the default
because it never lost to split pools on issue 15's traces, for any cache policy, and won up to 2.3x the
hit tokens and 4x lower TTFT where memory is tight (traces/cache_pressure/README.md, "Session 18").
`memory_summary()` says what was sized.

Engines. With `engine_dir` the engine directory is opened by `open_engine` (k3compile/engine): its
dtype, page size, decode buckets and tokenizer are the ones `build` wrote; `page_size` or
`cuda_graph_buckets` given here override them, a different `dtype` is refused.

Running limit. With the prefix cache each running request can hold up to MAX_TRANSIENT_SLOTS (4)
state slots (working slot, newest complete snapshot, the snapshot of the batch in flight and the
one being built), without it exactly one, so by default

    max_running = max(1, state_slot_capacity // slots_per_request)

where the capacity is the split pools' slot count, or for the unified arena the slots its whole
free space could hold. Checkpoints compete for the remaining slots and are evicted under pressure.

Context. `max_context` defaults to the model's max_position_embeddings, capped at 32768 and at what
one request can hold alone (every KV page, less its slots in an arena). A request's prompt plus
max_new_tokens must fit in it.

Stop conditions: the tokenizer's eos (unless ignore_eos), the request's stop_token_ids, and
max_new_tokens ("length"). The token that stopped a request is part of its output.

Parallel engines. An `engine_dir` built with `--topology` (or a `model` with `topology`, cut into ranks
at start-up) runs on all its ranks, one process each (runtime/parallel/rank_group.py): this engine
is rank 0 -- scheduler, radix cache, sampling -- and sends every step to the others. Pools and the
cache account per rank: every rank's pools get the smallest rank's budget, pages count tokens
(under DCP of M a page holds page_size / M rows on each rank), state slots hold a rank's KDA heads.
`rank_timeout_s` bounds how long a dead or hung rank can go unnoticed; it surfaces as a
FatalEngineError (RankFailure, naming the rank) out of `step()` / `check_health()`. Overlap and
speculative decoding are off for parallel engines.

Failures. A request whose sampling raises fails alone (finish_reason "error", `RequestOutput.error`
says why). A forward that raises is attributed by the scheduler (`Scheduler.fail_batch`): alone in
its batch, the request fails; sharing it, each request is recomputed from its tokens and from then
on runs in batches of its own, so only the request that causes it fails when it happens again. The
engine keeps serving either way.
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, replace

import torch

from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.recompute_cost import RecomputeCost
from k3compile.runtime.cache.request_table import RequestTable
from k3compile.runtime.cache.state_slots import MAX_TRANSIENT_SLOTS
from k3compile.model_def.dtypes import DTYPE_NAMES, DTYPES
from k3compile.runtime.executor import next_bucket, provider_device
from k3compile.runtime.fatal import FatalEngineError
from k3compile.runtime.memory.factory import make_memory
from k3compile.runtime.memory.pools import SplitPools
from k3compile.runtime.memory.sizing import PoolBudget, check_fraction, pool_budget
from k3compile.runtime.memory.unified import UnifiedArena
from k3compile.runtime.sampling import SamplingParams

from .cache_policy import CachePolicy, get_policy
from .batch_sampling import forks_after, needs_host, prepare_masks
from .inflight_memory import InFlightMemory
from .model_runner import InFlight, ModelRunner
from .sampler import to_device
from .request import Request
from .scheduler import DEFAULT_RESERVE_RATIO, ScheduledBatch, Scheduler, SchedulerConfig

MAX_DEFAULT_CONTEXT = 32768
DEFAULT_PAGE_SIZE = 16
DEFAULT_DTYPE = "fp32"

log = logging.getLogger("k3compile.engine")


@dataclass
class EngineArgs:
    model: str | None = "k3-tiny"
    engine_dir: str | None = None
    dtype: str | None = None  # None: the engine's own, else DEFAULT_DTYPE
    device: str = "cpu"
    seed: int = 0
    page_size: int | None = None  # None: the engine's (engine.json), else DEFAULT_PAGE_SIZE
    chunk_size: int = 256
    max_batch_tokens: int = 2048  # token budget of one step (vLLM's --max-num-batched-tokens)
    mixed_batches: bool = True  # decode tokens ride in prefill batches (scheduler.SchedulerConfig.mixed)
    max_running: int | None = None
    memory_bytes: int | None = None  # None: sized from the device (mem_fraction_static)
    mem_fraction_static: float | None = None  # None: sizing.DEFAULT_MEM_FRACTION_STATIC
    state_fraction: float | None = None  # split pools only; None: DEFAULT_STATE_FRACTION
    enable_unified_memory: bool | None = None  # None: the unified arena unless state_fraction asks for split pools
    enable_prefix_cache: bool = True
    overlap: bool | None = None  # None: on for CUDA devices (the launch is asynchronous there)
    track_interval: int = 256
    max_context: int | None = None
    # cache policy knobs (runtime/cache_policy.py)
    cache_policy: "str | CachePolicy" = "sparse"  # none | end | every_chunk | sparse | valued, or a CachePolicy
    checkpoint_interval: int | None = None  # checkpoint grid; None: page_size
    max_checkpoints_per_path: int | None = None  # None: the policy's; 0: no cap
    max_checkpoints: int | None = None  # None: the policy's; 0: no cap
    cuda_graphs: bool | None = None  # None: on for CUDA devices
    cuda_graph_buckets: tuple[int, ...] | None = None  # decode batch sizes with a graph; None: the engine's, else the executor's
    decode_reserve_ratio: float | None = None  # admission keeps pages for this share of remaining output; None: 0.7
    pad_decode_batches: bool | None = None  # pad decode batches to the buckets without graphs (CPU tests of the path)
    # speculative decoding (runtime/spec/): None | "ngram" | "dspark" (needs `draft`); or pass a proposer
    speculative: str | None = None
    draft: str | None = None  # the DSpark drafter's checkpoint directory
    num_speculative_tokens: int = 4  # gamma: drafts per request per step
    spec_window: str = "replay"  # "replay" (ReplaySSM fold) | "snapshot" (a state per draft position)
    spec_plan: str = "all"  # "all" (verify every draft) | "trim" (the planner, needs spec_profile)
    spec_profile: str | None = None  # cost profile JSON (k3compile profile verify)
    # parallel engines (runtime/parallel/): an engine_dir built with --topology brings its own
    topology: str | None = None  # with `model`: cut it into ranks at start-up (tpN, dcpM, tpN-dcpM, tepN)
    rank_timeout_s: float = 60.0  # a rank silent this long (collective timeout; hung after half of it) fails
    # time every decode forward on the device, per batch bucket, for metrics() (runtime/decode_timing.py)
    step_timing: bool = False


@dataclass
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list | None = None  # TokenLogprobs per new token, when the request asked for logprobs
    prompt_logprobs: list | None = None  # first output only: None for the first prompt token, then TokenLogprobs
    error: str | None = None  # finish_reason "error": what failed
    queue_time: float | None = None  # seconds from add_request to first admission (once admitted)


def _checkpoint_interval(args: EngineArgs) -> int:
    """The grid checkpoints sit on. Default: every page boundary. A checkpoint needs a forward that
    ends there (the scheduler cuts a chunk at a branch point or the prompt's last boundary), so a
    finer grid costs no extra copies, only finer cut points -- and hits lose less than a grid step.
    (SGLang uses 64, the FLA chunk, because it reads states out of the chunked kernel instead.)"""
    p, c, t = args.page_size, args.chunk_size, args.track_interval
    g = args.checkpoint_interval
    if g is None or not args.enable_prefix_cache:
        return p
    if g < 1 or g % p or c % g or t % g:
        raise ValueError(f"checkpoint_interval {g} must be a positive multiple of page_size {p} that divides "
                         f"chunk_size {c} and track_interval {t}")
    return g


def _rank_source(args: EngineArgs):
    """Where the ranks' weights come from, for a parallel engine (else None)."""
    from k3compile.runtime.parallel.rank_provider import RankSource

    if args.engine_dir is not None:
        from k3compile.engine import format as fmt
        if "ranks" in fmt.read_manifest(args.engine_dir):
            return RankSource(engine_dir=args.engine_dir)
        return None
    if args.topology not in (None, "single"):
        return RankSource(model=args.model, topology=args.topology, dtype=args.dtype or DEFAULT_DTYPE, seed=args.seed)
    return None


def unified_memory(enable_unified_memory: bool | None, state_fraction: float | None) -> bool:
    """The memory kind EngineArgs ask for: the unified arena unless a state share asks for split pools."""
    if enable_unified_memory and state_fraction is not None:
        raise ValueError("state_fraction sizes split pools; the unified arena has no fixed state share "
                         "(give one of enable_unified_memory and state_fraction)")
    return state_fraction is None if enable_unified_memory is None else enable_unified_memory


def _check_args(args: EngineArgs, have_model: bool) -> None:
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.model is None and args.engine_dir is None and not have_model:
        raise ValueError("give a model (preset or checkpoint directory) or an engine_dir")
    for name in ("page_size", "chunk_size", "max_batch_tokens", "track_interval"):
        v = getattr(args, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if args.mem_fraction_static is not None:
        check_fraction(args.mem_fraction_static)
    p = args.page_size
    if args.enable_prefix_cache and (args.chunk_size % p or args.track_interval % p):
        raise ValueError(f"chunk_size ({args.chunk_size}) and track_interval ({args.track_interval}) must be "
                         f"multiples of page_size ({p}) so checkpoints land on page boundaries")
    if args.max_running is not None and args.max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {args.max_running}")
    if args.memory_bytes is not None and args.memory_bytes <= 0:
        raise ValueError(f"memory_bytes must be positive, got {args.memory_bytes}")
    if args.state_fraction is not None and not 0.0 < args.state_fraction < 1.0:
        raise ValueError(f"state_fraction must be in (0, 1), got {args.state_fraction}")
    unified_memory(args.enable_unified_memory, args.state_fraction)
    if args.decode_reserve_ratio is not None and not 0.0 <= args.decode_reserve_ratio <= 1.0:
        raise ValueError(f"decode_reserve_ratio must be in [0, 1], got {args.decode_reserve_ratio}")
    if args.max_context is not None and args.max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {args.max_context}")


class LLMEngine:
    def __init__(self, args: EngineArgs, model=None, eos_token_id: int | None = None, proposer=None):
        """`model`: an already loaded model or compiled Engine to use instead of loading one (args.model
        and args.engine_dir then only name where the tokenizer is; both None: token ids only).
        `eos_token_id`: overrides the tokenizer's. `proposer`: a speculative-decoding proposer
        (runtime/spec/proposer.py) to use instead of the one `args.speculative` names."""
        # cheap checks before loading anything; again once the engine filled in its settings
        _check_args(replace(args, page_size=DEFAULT_PAGE_SIZE) if args.page_size is None else args, model is not None)
        self.ranks = None
        try:
            self._setup(args, model, eos_token_id, proposer)
        except BaseException:
            if self.ranks is not None:  # started rank processes must not outlive a failed start
                self.ranks.close()
            raise

    def _setup(self, args: EngineArgs, model, eos_token_id: int | None, proposer) -> None:
        opened = None
        if model is not None:
            self.provider = model
        elif _rank_source(args) is not None:
            from k3compile.runtime.parallel.rank_group import RankGroup
            if args.speculative is not None or proposer is not None:
                raise ValueError("speculative decoding is not supported on a parallel engine yet")
            self.ranks = RankGroup(_rank_source(args), args.device, args.rank_timeout_s)
            self.provider = self.ranks.provider
            built = DTYPE_NAMES[self.provider.dtype]
            if args.engine_dir is not None and args.dtype not in (None, built):
                raise ValueError(f"engine {args.engine_dir} was built for {built}, not dtype {args.dtype} "
                                 f"(rebuild it to change)")
            args = replace(args, overlap=False)
        elif args.engine_dir is not None:
            opened = self._open(args)
            self.provider = opened.engine
        else:
            self.provider = self._load(args)
        self.config = self.provider.config
        args = self.args = self._settle_args(args, self.provider)
        _check_args(args, True)
        self.tokenizer = opened.tokenizer if opened is not None else self._tokenizer(args)
        if eos_token_id is None:
            eos_token_id = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else self.config.eos_token_id
        self.eos_token_id = eos_token_id
        device = str(provider_device(self.provider))
        if args.overlap is None:
            args = self.args = replace(args, overlap=device.startswith("cuda"))

        spec = self.provider.cache_spec()
        self.budget = pool_budget(device, args.mem_fraction_static, args.memory_bytes)
        if self.ranks is not None:  # every rank gets what the tightest one can hold
            least = self.ranks.agree_budget(args.mem_fraction_static, args.memory_bytes, self.budget.bytes)
            self.budget = PoolBudget(least, f"{self.budget.source}, per rank: the smallest of "
                                            f"{self.ranks.world} ranks")
        inner = make_memory(spec, self.budget.bytes, args.page_size, args.enable_unified_memory,
                            args.state_fraction, device)
        self.memory = InFlightMemory(inner)
        if self.ranks is not None:
            self.memory.ops = []  # replayed on the other ranks before each step
        policy = args.cache_policy if isinstance(args.cache_policy, CachePolicy) else get_policy(args.cache_policy)
        if not args.enable_prefix_cache:
            policy = get_policy("none")
        per_path = policy.max_checkpoints_per_path if args.max_checkpoints_per_path is None else (
            args.max_checkpoints_per_path or None)
        total = policy.max_checkpoints if args.max_checkpoints is None else (args.max_checkpoints or None)
        self.policy = policy.with_caps(per_path, total)
        interval = _checkpoint_interval(args)
        cost = RecomputeCost.from_config(self.config) if self.policy.eviction == "value" else None
        self.cache = HybridRadixCache(self.memory, interval, per_path, total, eviction=self.policy.eviction,
                                      recompute_cost=cost, value_weight=self.policy.value_weight,
                                      unused_ttl=self.policy.unused_ttl, unused_max_age=self.policy.unused_max_age,
                                      protect_reused=self.policy.protect_reused, stale_age=self.policy.stale_age,
                                      root_clock_new_only=self.policy.unused_root_new_only,
                                      protect_shared_leaves=self.policy.protect_shared_leaves,
                                      short_unused_ttl=self.policy.short_unused_ttl,
                                      short_unused_max_age=self.policy.short_unused_max_age,
                                      short_stale_age=self.policy.short_stale_age,
                                      root_stale_unused_global=self.policy.root_stale_unused_global,
                                      decay_keeps_kv=self.policy.decay_keeps_kv,
                                      protect_branch_leaves=self.policy.protect_branch_leaves,
                                      kv_value_weight=self.policy.kv_value_weight)
        self.table = RequestTable(self.cache)

        slots_per_request = MAX_TRANSIENT_SLOTS if self.policy.enabled else 1
        slot_capacity, page_capacity = self._capacity(inner, spec, slots_per_request)
        self.max_context = self._max_context(args, page_capacity)
        max_running = args.max_running or max(1, slot_capacity // slots_per_request)
        self.scheduler = Scheduler(self.memory, self.cache, self.table, self.policy, SchedulerConfig(
            page_size=args.page_size, chunk_size=args.chunk_size, max_batch_tokens=args.max_batch_tokens,
            max_running=max_running, track_interval=args.track_interval, checkpoint_interval=interval,
            decode_reserve_ratio=DEFAULT_RESERVE_RATIO if args.decode_reserve_ratio is None else args.decode_reserve_ratio,
            device=device, decode_snapshots=proposer is None and args.speculative is None,
            mixed=args.mixed_batches))
        if self.ranks is None:
            self.runner = ModelRunner(self.provider, self.memory, self.max_context, overlap=args.overlap,
                                      cuda_graphs=args.cuda_graphs, buckets=args.cuda_graph_buckets,
                                      pad_to_buckets=args.pad_decode_batches, step_timing=args.step_timing)
        else:
            if args.step_timing:
                raise ValueError("step timing is not supported on a parallel engine yet")
            from k3compile.runtime.parallel.messages import RankSetup
            from k3compile.runtime.parallel.rank_runner import RankZeroRunner
            self.ranks.setup(RankSetup(args.enable_unified_memory, self.budget.bytes, args.page_size,
                                       args.state_fraction, self.max_context, args.cuda_graphs,
                                       args.cuda_graph_buckets, args.pad_decode_batches))
            self.runner = RankZeroRunner(self.ranks, self.provider, self.memory, self.max_context,
                                         cuda_graphs=args.cuda_graphs, buckets=args.cuda_graph_buckets,
                                         pad_to_buckets=args.pad_decode_batches)
        self.spec = None
        if proposer is not None or args.speculative is not None:
            from k3compile.runtime.spec.setup import kda_launch_layout, make_spec_decoder
            ex = self.runner.executor
            self.spec = make_spec_decoder(args, self.provider, spec, max_running, device, proposer,
                                          window_rows=next_bucket(max_running, ex.buckets) or max_running,
                                          padded=ex.pad_to_buckets,
                                          kda_launch=kda_launch_layout(getattr(self.provider, "manifest", None)))
            ex.prepare_verify(self.spec.window, self.spec.gamma + 1, self.spec.feature_layers)
        self._requests: dict[str, Request] = {}  # added and not yet reported finished
        self._outbox: dict[str, Request] = {}  # requests with something to report at the next step
        self._inflight: InFlight | None = None
        self._gen_ids = itertools.count()
        self._warm: dict | None = None  # what warmup() did, once it ran

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _open(args: EngineArgs):
        from k3compile.engine import open_engine

        opened = open_engine(args.engine_dir, device=args.device)
        if args.dtype is not None and args.dtype != opened.dtype:
            raise ValueError(f"engine {args.engine_dir} was built for {opened.dtype}, not dtype {args.dtype} "
                             f"(rebuild it to change)")
        return opened

    @staticmethod
    def _load(args: EngineArgs):
        from k3compile.model_def.loader import load_model
        return load_model(args.model, dtype=DTYPES[args.dtype or DEFAULT_DTYPE], device=args.device, seed=args.seed,
                          progress=False)

    @staticmethod
    def _settle_args(args: EngineArgs, provider) -> EngineArgs:
        """Fill what the args leave open: the memory kind (the unified arena unless a state share asks for
        split pools); from the provider, the page size, decode buckets and dtype an Engine was built with."""
        def first(*values):
            return next((v for v in values if v is not None), None)

        return replace(
            args, enable_unified_memory=unified_memory(args.enable_unified_memory, args.state_fraction),
            page_size=first(args.page_size, getattr(provider, "page_size", None), DEFAULT_PAGE_SIZE),
            cuda_graph_buckets=first(args.cuda_graph_buckets, getattr(provider, "decode_buckets", None)),
            dtype=first(args.dtype, DTYPE_NAMES.get(getattr(provider, "dtype", None)), DEFAULT_DTYPE))

    def _tokenizer(self, args: EngineArgs):
        from k3compile.engine.opened import engine_tokenizer
        from k3compile.tokenizer import load_tokenizer

        if args.engine_dir is not None:
            if self.ranks is not None:  # a parallel engine: every rank directory has the tokenizer
                from k3compile.engine import format as fmt
                rank0 = fmt.read_manifest(args.engine_dir)["ranks"]["0"]
                return engine_tokenizer(os.path.join(args.engine_dir, rank0), self.config)
            return engine_tokenizer(args.engine_dir, self.config)
        if args.model is None:
            return None
        try:
            return load_tokenizer(args.model, self.config)
        except ValueError:
            return None  # no tokenizer for this model: token ids only

    def memory_summary(self) -> str:
        """What the memory was sized to, for the start-up log."""
        mem, p = self.memory, self.args.page_size
        pages, slots = mem.num_free_pages() + mem.num_used_pages(), mem.num_free_slots() + mem.num_used_slots()
        kind = "one unified arena" if self.args.enable_unified_memory else "split pools"
        return (f"memory: {self.budget.bytes / (1 << 20):.0f} MiB for KV + KDA state ({self.budget.source}); "
                f"{kind}: {pages * p} tokens of KV ({pages} pages of {p}), {slots} state slots; "
                f"up to {self.scheduler.cfg.max_running} requests running, context {self.max_context} tokens")

    @staticmethod
    def _capacity(inner, spec, slots_per_request: int) -> tuple[int, int]:
        """(state slots the memory can hold, KV pages one request can hold alone)."""
        if isinstance(inner, SplitPools):
            return inner.total_slots, inner.total_pages
        free = inner.free_bytes()
        pages_alone = (free - slots_per_request * inner.slot_bytes) // inner.page_bytes
        return free // inner.slot_bytes, max(0, pages_alone)

    def _max_context(self, args: EngineArgs, page_capacity: int) -> int:
        cap = page_capacity * args.page_size
        if args.max_context is not None:
            if args.max_context > cap:
                raise ValueError(f"max_context {args.max_context} does not fit the memory: one request can hold "
                                 f"at most {cap} tokens of KV in {self.budget.bytes} bytes ({self.budget.source})")
            return args.max_context
        ctx = min(default_context(self.config), cap)
        if ctx < 2:
            raise ValueError(f"{self.budget.bytes} bytes of pools ({self.budget.source}) leave room for {cap} "
                             f"tokens per request")
        return ctx

    # ------------------------------------------------------------------ requests
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    fork_rids: tuple[str, ...] = ()) -> None:
        """`fork_rids`: more requests (n > 1) with the same prompt and params that share this one's
        prefill and fork its state (scheduler `_fork`); each reports under its own id. With a seed,
        the i-th of them samples with seed + i + 1."""
        for r in (rid, *fork_rids):
            if r in self._requests:
                raise ValueError(f"request id {r!r} is already in use")
        if len(set(fork_rids) | {rid}) != len(fork_rids) + 1:
            raise ValueError(f"request ids must be distinct, got {[rid, *fork_rids]}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = list(map(int, prompt_ids))
        if not prompt:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:  # min/max: no Python loop on long prompts
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            raise ValueError(f"request {rid!r}: token id(s) {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise ValueError(f"request {rid!r}: prompt ({len(prompt)} tokens) + max_new_tokens "
                             f"({params.max_new_tokens}) exceeds the context length {self.max_context}")
        stops = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stops.add(self.eos_token_id)
        guide = None
        if params.guide is not None:
            from k3compile.runtime.structured_output import compile_guide
            guide = compile_guide(self, params.guide)  # ValueError for a bad schema / grammar
        req = Request(rid, prompt, params, frozenset(stops), generator=params.generator(),
                      guide=guide and guide.matcher())
        for i, frid in enumerate(fork_rids):
            gen = None if params.seed is None else torch.Generator().manual_seed(params.seed + i + 1)
            f = Request(frid, list(prompt), params, frozenset(stops), generator=gen, fork_leader=req,
                        guide=guide and guide.matcher())
            req.followers.append(f)
            self._requests[frid] = f
        self._requests[rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        req = self._requests.get(rid)
        if req is None or req.finished:
            return
        self.scheduler.abort(req)
        self._outbox[rid] = req

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._inflight is not None or bool(self.scheduler.running) \
            or bool(self.scheduler.waiting)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list["RequestOutput"]:
        """One scheduler iteration. Not thread-safe: call from one thread."""
        if not self.args.overlap:
            batch = self.scheduler.schedule()
            if batch is not None:
                if self._speculates(batch):
                    self._finish_spec(batch)
                else:
                    self._fill_placeholders(batch)
                    self._finish(self.runner.run(batch))
            return self._collect()
        # Overlap: plan batch N+1 while batch N runs, launch N+1 behind N (its placeholders read N's
        # sampled ids on the device), and only then wait for N's ids and apply them.
        nxt = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        if nxt is not None and prev is not None and (
                needs_host(nxt) or forks_after(prev.batch) or self._speculates(nxt)):
            # N+1's sampling reads what N changes (outputs, matcher state), N forks followers from a
            # working state that N+1 would advance, or N+1 speculates (its drafts need N's tokens): N first
            self._finish(prev)
            prev = None
        if nxt is not None and all(row.req.finished for row in nxt.rows):  # everyone in it finished meanwhile
            self.scheduler.process(nxt, [None] * len(nxt.rows))
            nxt = None
        if nxt is not None:
            if self._speculates(nxt):  # drafts need the committed tokens: runs once the one in flight is done
                self._fill_placeholders(nxt)
                self._finish_spec(nxt)
            else:
                sources = self._fill_placeholders(nxt, prev)
                prepare_masks(nxt)
                self._inflight = self.runner.launch(nxt, prev, sources)
        if prev is not None:
            self._finish(prev)
        return self._collect()

    def _finish(self, job: InFlight) -> None:
        """Wait for a batch's sampled ids and apply them. A failure fails the request that caused it."""
        batch = job.batch
        try:
            sampled, errors = job.result()
        except FatalEngineError:
            raise  # no request is to blame: the engine is lost
        except Exception as e:
            log.error("a %s step over %d request(s) failed", batch.mode, len(batch.rows), exc_info=e)
            self._note(self.scheduler.fail_batch(batch, f"the {batch.mode} step failed: {e!r}"))
            return
        self._note(self.scheduler.process(batch, sampled))
        if job.features is not None:  # a drafter reads target features: the prefill step emitted them
            self.spec.observe_prefill(batch, job.features)
        for i, err in errors.items():
            req = batch.rows[i].req
            log.warning("request %s failed: %s", req.rid, err)
            self.scheduler.fail(req, err)
            self._outbox[req.rid] = req

    def _speculates(self, batch: ScheduledBatch) -> bool:
        return self.spec is not None and batch.mode == "decode"

    def _finish_spec(self, batch: ScheduledBatch) -> None:
        """A decode batch as one speculative step (runtime/spec/spec_decode.py): draft, verify, accept,
        commit; then the scheduler applies the sampled token and the accepted ones after it."""
        try:
            res = self.spec.run(batch, self.runner.executor, self.scheduler.table, self.args.page_size,
                                self.max_context, self.runner.sample)
        except Exception as e:
            log.exception("a speculative step over %d request(s) failed", len(batch.rows))
            self._note(self.scheduler.fail_batch(batch, f"the speculative decode step failed: {e!r}"))
            return
        if res is None:  # the planner found plain decode faster than any verify: run the batch as one
            self._finish(self.runner.run(batch))
            self.spec.observe(r.req for r in batch.rows)
            return
        touched = self.scheduler.process(batch, res.sampled) + self.scheduler.extend(batch, res.extra)
        self._note(touched)
        self.spec.observe({id(r): r for r in touched}.values())
        for i, err in res.errors.items():
            req = batch.rows[i].req
            self.scheduler.fail(req, err)
            self._outbox[req.rid] = req

    @staticmethod
    def _fill_placeholders(batch: ScheduledBatch, prev: InFlight | None = None) -> dict[int, int]:
        """Fill the input ids whose token is on the host now; return {input index: row of `prev`}
        for those `prev` samples (the runner reads them from the device)."""
        if not batch.placeholders:
            return {}
        rows_of_prev = {} if prev is None else {id(r.req): i for i, r in enumerate(prev.batch.rows) if r.samples}
        idx, toks, sources = [], [], {}
        for i, row in batch.placeholders:
            req = row.req
            if row.start < req.num_tokens:
                idx.append(i)
                toks.append(req.token_at(row.start))
            elif id(req) in rows_of_prev:
                sources[i] = rows_of_prev[id(req)]
            # else a zombie row: its token stays 0
        if idx:
            ids = batch.forward.input_ids
            ids.index_copy_(0, to_device(idx, torch.int64, ids.device), to_device(toks, ids.dtype, ids.device))
        return sources

    def _note(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._outbox[r.rid] = r

    def _collect(self) -> list[RequestOutput]:
        outs = []
        for rid, req in self._outbox.items():
            new = req.output_ids[req.num_reported:]
            if not new and not (req.finished and not req.finish_reported):
                continue
            lps = req.output_logprobs[req.num_reported:] if req.params.logprobs is not None else None
            plp = None
            if req.params.prompt_logprobs is not None and not req.prompt_reported:
                req.prompt_reported, plp = True, [None] + list(req.prompt_lp)
            req.num_reported = len(req.output_ids)
            if req.finished:
                req.finish_reported = True
                self._requests.pop(rid, None)
                if self.spec is not None:  # aborted ones too: the proposer drops its per-request context
                    self.spec.release(rid)
            outs.append(RequestOutput(rid, list(new), req.finished, req.finish_reason, len(req.prompt_ids),
                                      len(req.output_ids), req.cached_tokens, lps, plp, error=req.error,
                                      queue_time=req.queue_time))
        self._outbox.clear()
        return outs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (alongside anything already queued); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        rids = [f"generate-{next(self._gen_ids)}" for _ in prompts]
        for rid, ids, p in zip(rids, prompts, plist):
            self.add_request(rid, ids, p)
        out = {rid: [] for rid in rids}
        pending, errors = set(rids), []
        while pending:
            for o in self.step():
                if o.rid in out:
                    out[o.rid].extend(o.new_token_ids)
                    if o.finished:
                        pending.discard(o.rid)
                    if o.error is not None:
                        errors.append(f"prompt {rids.index(o.rid)}: {o.error}")
        if errors:
            raise RuntimeError("; ".join(errors))
        return [out[rid] for rid in rids]

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> dict:
        """Do before serving what the first requests would otherwise do lazily: compile the prefill
        step's kernels (Triton JIT and autotuning) for a full chunk and for a mixed batch of short
        prompts, and run decode steps at batch sizes up to the largest bucket the running limit
        allows (the decode CUDA graphs themselves are captured when the runner is built). Requests
        of random tokens that generate a few tokens each; their counters are reset afterwards.
        Returns {"seconds", "requests", "decode_batch"}."""
        import random
        import time

        if self._warm is not None:
            return self._warm
        if self.has_unfinished():
            raise RuntimeError("warm up before adding requests")
        t0 = time.perf_counter()
        rng = random.Random(0)
        vocab = self.config.vocab_size
        cuda = self.provider_device_type() == "cuda"
        # on a CPU nothing compiles: one short request checks the path end to end and costs little
        chunk = min(self.args.chunk_size if cuda else 8, self.max_context - 4)
        buckets = self.runner.executor.buckets
        width = max([b for b in buckets if b <= self.scheduler.cfg.max_running] or [1]) if cuda else 0
        params = SamplingParams(max_new_tokens=3 if cuda else 2, ignore_eos=True)
        self.generate([[rng.randrange(vocab) for _ in range(chunk)]], params)   # one full chunk
        if width:   # short prompts (mixed rows), then decode batches of `width`
            self.generate([[rng.randrange(vocab) for _ in range(1 + i % 7)] for i in range(width)], params)
        s = self.scheduler
        s.generated_tokens = s.prefill_tokens = s.prompt_tokens = s.cache_hit_tokens = 0
        s.first_tokens = s.first_token_forwards = 0
        s.first_token_seconds = 0.0
        if self.cache.num_checkpoints():   # leave the cache as empty as it was
            self.cache.evict_checkpoints(self.cache.num_checkpoints())
        if self.cache.evictable_pages():
            self.cache.evict_pages(self.cache.evictable_pages())
        if cuda:
            torch.cuda.synchronize()
        timer = getattr(self.runner, "timer", None)
        if timer is not None:   # the served figures start after the warm-up, like the counters above
            timer.reset()
        prefill_timer = getattr(self.runner, "prefill_timer", None)
        if prefill_timer is not None:
            prefill_timer.reset()
        self._warm = {"seconds": time.perf_counter() - t0, "requests": 1 + bool(width) * width, "decode_batch": width}
        return self._warm

    def provider_device_type(self) -> str:
        return self.runner.executor.device.type

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        s, mem, inner = self.scheduler, self.memory, self.memory.inner
        used_s, used_p = mem.num_used_slots(), mem.num_used_pages()
        total_s, total_p = used_s + mem.num_free_slots(), used_p + mem.num_free_pages()
        st = self.cache.stats()
        return {
            "running": s.num_running(), "queued": len(s.waiting), "max_running": s.cfg.max_running,
            "generated_tokens": s.generated_tokens, "prefill_tokens": s.prefill_tokens,
            "prompt_tokens": s.prompt_tokens, "cache_hit_tokens": s.cache_hit_tokens,
            "cache_hit_rate": s.cache_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "slots_used": used_s, "slots_total": total_s, "pages_used": used_p, "pages_total": total_p,
            "state_pool_usage": used_s / total_s if total_s else 0.0,
            "kv_pool_usage": used_p / total_p if total_p else 0.0,
            "checkpoints": st.num_checkpoints, "checkpoint_bytes": st.checkpoint_bytes,
            "peak_checkpoint_bytes": st.peak_checkpoint_bytes, "tree_pages": st.num_pages,
            "retractions": s.retractions, "forked_requests": s.forked, "unified_memory": isinstance(inner, UnifiedArena),
            "cache_policy": self.policy.name,
            "first_token": {"requests": s.first_tokens, "prefill_forwards": s.first_token_forwards,
                            "seconds": s.first_token_seconds},
            **self._decode_forward_metrics(),
            **self._prefill_forward_metrics(),
        }

    def _decode_forward_metrics(self) -> dict:
        """With step timing: {"decode_forward": {bucket: {"forwards", "seconds"}}} (string keys: the snapshot
        crosses a pipe as JSON-like data with --engine-process)."""
        timer = getattr(self.runner, "timer", None)
        if timer is None:
            return {}
        return {"decode_forward": {str(b): {"forwards": n, "seconds": s} for b, (n, s) in timer.totals().items()}}

    def _prefill_forward_metrics(self) -> dict:
        """With step timing: {"prefill_forward": {"forwards", "tokens", "host_seconds", "device_forwards",
        "device_seconds"}} (runtime/prefill_timing.py)."""
        timer = getattr(self.runner, "prefill_timer", None)
        return {} if timer is None else {"prefill_forward": timer.totals()}

    def check_health(self) -> None:
        """Raise FatalEngineError if the engine cannot go on (a rank of a parallel engine died or hung)."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def __del__(self):
        runner = getattr(self, "runner", None)
        if runner is not None and runner._worker is not None:
            runner._worker.shutdown(wait=False)


def default_context(config) -> int:
    """The context an engine gets without --max-context: the model's, capped at MAX_DEFAULT_CONTEXT (the memory
    may cap it lower: LLMEngine._max_context)."""
    return min(config.max_position_embeddings, MAX_DEFAULT_CONTEXT)
