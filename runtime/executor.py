"""Executor: runs a model's or an engine's step over the runtime's pools; CUDA graphs for decode.

    ex = Executor(engine, pools.tensors, max_context=8192)        # device and CUDA graphs follow the pools
    logits = ex.run(batch)                                        # [M, V] fp32

API (what the scheduler uses):
* `Executor(provider, cache, device=None, cuda_graphs=None, buckets=DECODE_BUCKETS, max_context=4096,
  pad_to_buckets=None, compile_decode=None)`. `provider` is anything with
  `step_tensors(mode, *STEP_INPUTS) -> logits` (K3ForCausalLM, Engine), or a dict {mode: fn(*STEP_INPUTS)}.
  `cache` are the pools the steps read and write; the executor never allocates or moves them, so a
  captured graph stays valid for the executor's lifetime (the runtime may move blocks *inside* them).
* `run(batch)`: one step. Prefill runs eagerly. A decode batch of B requests, B <= the largest
  bucket, is padded to the next bucket and replayed from that bucket's CUDA graph; larger decode
  batches run eagerly. Decode batches carry one logits row per request, in request order.
* The logits a graph replay returns are a view of the graph's static output: read (or copy) them
  before the next `run`.

Padding: the padded rows are requests that cannot hurt anyone: token 0, state slot 0, KV page 0
(both reserved sinks that no real request owns), context length 1 (so attention reads one valid
row), writing their KV row to page 0. They compute garbage into the sinks only.

Static shapes: the page table is copied into a [bucket, max_pages] buffer with max_pages =
ceil(max_context / page_size), fixed per executor; batches with longer contexts are refused.

`pad_to_buckets` runs that same padded path without graph capture (on CPU, so tests can check
that padding changes no real request's numbers). `compile_decode` hands the decode step to
Inductor (`torch.compile(mode=...)`) before capture; off by default until it measures faster, and
it needs the pools as separate tensors (aot_autograd cannot mutate two views of one buffer).
"""
from __future__ import annotations

import inspect
from typing import Callable, Mapping, Protocol

import torch

from k3compile.model_def.batch import ForwardBatch, step_args
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.draft_window import VERIFY_MODES

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_MAX_CONTEXT = 4096
WARMUP_RUNS = 2  # eager runs on a side stream before capture: lazy inits, autotuning, allocator warm-up


class StepProvider(Protocol):
    def step_tensors(self, mode: str, *args: torch.Tensor) -> torch.Tensor: ...


StepFn = Callable[..., torch.Tensor]


def step_function(provider, mode: str) -> StepFn:
    """The callable that runs `mode` steps: fn(*STEP_INPUTS) -> logits."""
    if isinstance(provider, Mapping):
        if mode not in provider:
            raise ValueError(f"no {mode!r} step in {sorted(provider)}")
        return provider[mode]
    if not hasattr(provider, "step_tensors"):
        raise TypeError(f"{type(provider).__name__} is not a step provider: it needs step_tensors(mode, ...) "
                        f"or must be a dict of step functions")
    graphs = getattr(provider, "graphs", None)  # an Engine: call its GraphModule directly (Inductor can see it)
    if isinstance(graphs, Mapping) and mode in graphs:
        return graphs[mode]

    def fn(*args):
        return provider.step_tensors(mode, *args)
    return fn


def provider_device(provider) -> torch.device:
    """Where a provider's weights live (a model's parameters, an engine's graphs)."""
    if isinstance(provider, torch.nn.Module):
        return next(provider.parameters()).device
    if hasattr(provider, "device"):
        return torch.device(provider.device)
    raise TypeError(f"cannot tell which device {type(provider).__name__} runs on")


def next_bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


class Executor:
    def __init__(self, provider, cache: CacheTensors, device=None, cuda_graphs: bool | None = None,
                 buckets=DECODE_BUCKETS, max_context: int = DEFAULT_MAX_CONTEXT, pad_to_buckets: bool | None = None,
                 compile_decode: str | None = None):
        self.cache = cache
        self._provider = provider
        self.device = torch.device(device) if device is not None else cache.kv.device
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the pools are on {self.device}")
        self.pad_to_buckets = self.cuda_graphs if pad_to_buckets is None else (pad_to_buckets or self.cuda_graphs)
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.page_size = cache.page_size
        self.max_pages = -(-max_context // self.page_size)
        self.max_context = self.max_pages * self.page_size
        self._prefill = step_function(provider, "prefill") if _has_mode(provider, "prefill") else None
        self._decode = step_function(provider, "decode")
        if compile_decode:
            if _pools_alias(cache):
                raise ValueError("compile_decode needs pools that are separate tensors: aot_autograd cannot trace "
                                 "in-place updates of two views of one buffer (the slot layout of split pools)")
            self._decode = torch.compile(self._decode, mode=compile_decode, fullgraph=True)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.feature_layers: tuple[int, ...] = ()  # set by prepare_verify for drafters that read target features
        if self.pad_to_buckets:
            self._alloc_static()
        if self.cuda_graphs:
            self.capture()

    # ---- static decode inputs ----
    def _alloc_static(self) -> None:
        n, dev = self.buckets[-1], self.device
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        # filled with the padding request (see module docstring); real rows are overwritten per run
        self.s_input_ids = torch.zeros(n, **i64)
        self.s_cu_seqlens = torch.arange(n + 1, **i32)  # one token per request: the same for every decode batch
        self.s_seq_lens = torch.ones(n, **i32)
        self.s_page_table = torch.zeros(n, self.max_pages, **i32)
        self.s_state_slots = torch.zeros(n, **i64)
        self.s_out_cache_loc = torch.zeros(n, **i64)
        self.s_logits_indices = torch.arange(n, **i64)
        self._filled = 0  # rows [0, _filled) may hold a previous batch's requests

    def _static_args(self, bs: int) -> tuple:
        c = self.cache
        return (self.s_input_ids[:bs], self.s_cu_seqlens[:bs + 1], self.s_seq_lens[:bs], self.s_page_table[:bs],
                self.s_state_slots[:bs], self.s_out_cache_loc[:bs], self.s_logits_indices[:bs], c.ssm, c.conv, c.kv)

    def _load_batch(self, batch: ForwardBatch) -> None:
        b = batch.batch_size
        if self._filled > b:  # rows a bigger previous batch left behind become padding again
            self.s_input_ids[b:self._filled].zero_()
            self.s_seq_lens[b:self._filled].fill_(1)
            self.s_page_table[b:self._filled].zero_()
            self.s_state_slots[b:self._filled].zero_()
            self.s_out_cache_loc[b:self._filled].zero_()
        self._filled = b
        w = min(batch.page_table.shape[1], self.max_pages)
        self.s_input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.s_seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        if w < self.max_pages:
            self.s_page_table[:b, w:].zero_()
        self.s_page_table[:b, :w].copy_(batch.page_table[:, :w], non_blocking=True)
        self.s_state_slots[:b].copy_(batch.state_slots, non_blocking=True)
        self.s_out_cache_loc[:b].copy_(batch.out_cache_loc, non_blocking=True)

    # ---- CUDA graphs ----
    def capture(self) -> None:
        """Capture one decode graph per bucket, largest first so smaller graphs reuse its memory pool."""
        pool = None
        for bs in sorted(self.buckets, reverse=True):
            if bs in self._graphs:
                continue
            args = self._static_args(bs)  # padding rows only: warm-up and capture touch the sinks alone
            self._graphs[bs] = self._capture_one(self._decode, args, pool)
            pool = self._graphs[bs][0].pool()
        torch.cuda.synchronize(self.device)

    def _capture_one(self, fn, args, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm `fn(*args)` up on a side stream, then capture it into a graph sharing `pool`."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(WARMUP_RUNS):
                fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), torch.no_grad():
            out = fn(*args)
        return graph, out

    # ---- running ----
    def decode_size(self, batch_size: int) -> int:
        """The batch size a decode batch of `batch_size` requests runs at: its bucket when padding is on and one
        holds it (the CUDA graph replayed), else its own size (eager)."""
        return (next_bucket(batch_size, self.buckets) if self.pad_to_buckets else None) or batch_size

    @torch.no_grad()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.mode == "prefill":
            if self._prefill is None:
                raise ValueError("this step provider has no prefill step")
            return self._prefill(*step_args(batch, self.cache))
        if batch.mode != "decode":
            raise ValueError(f"unsupported step mode {batch.mode!r}")
        b = batch.batch_size
        bs = next_bucket(b, self.buckets) if self.pad_to_buckets else None
        if bs is None:  # bigger than every bucket (or padding off): eager at its own size
            return self._decode(*step_args(batch, self.cache))
        if batch.logits_indices.shape[0] != b:
            raise ValueError(f"decode batches have one logits row per request: {b} requests, "
                             f"{batch.logits_indices.shape[0]} logits rows")
        if batch.seq_lens_cpu and max(batch.seq_lens_cpu) > self.max_context:
            raise ValueError(f"a request's context ({max(batch.seq_lens_cpu)} tokens) exceeds this executor's "
                             f"max_context ({self.max_context})")
        self._load_batch(batch)
        if bs in self._graphs:
            graph, out = self._graphs[bs]
            graph.replay()
        else:
            out = self._decode(*self._static_args(bs))
        return out[:b]


    # ---- verify steps (speculative decoding) ----
    def prepare_verify(self, window, max_len: int, feature_layers: tuple[int, ...] = ()) -> None:
        """Use `window` (model_def.draft_window.DraftWindow) for every verify step from now on; with
        padding on, verify batches are padded to (batch bucket, tokens per request) buckets -- one
        CUDA graph each when graphs are on, captured here, largest first, sharing one memory pool.

        `feature_layers` (a drafter that reads target features, e.g. DSpark): from now on prefill and
        verify steps return (logits, features [tokens, F]) of those layers for every real token."""
        mode = window.spec.step_mode
        if not _has_mode(self._provider, mode):
            raise ValueError(f"this step provider has no {mode!r} step (build the engine with --verify-graphs)")
        self._window, self._verify_fn = window, step_function(self._provider, mode)
        self.feature_layers = tuple(feature_layers)
        if self.feature_layers:
            if not emits_features(self._provider):
                raise ValueError(f"the drafter reads target features of layers {self.feature_layers}, but this step "
                                 f"provider ({type(self._provider).__name__}) does not emit them: a compiled engine's "
                                 f"captured graphs return logits only; run the target from --model (eager)")
            self._verify_fn = _with_features(self._provider, mode, self.feature_layers)
            self._prefill = _with_features(self._provider, "prefill", self.feature_layers)
        self._verify_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._verify_inputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # a graph's static batch inputs
        self.verify_buckets = tuple(b for b in self.buckets if b <= window.rows)
        self.max_verify_len = min(max_len, window.spec.length)
        if not self.cuda_graphs:
            return
        pool = None
        for bs in sorted(self.verify_buckets, reverse=True):
            for n in range(self.max_verify_len, 0, -1):
                args = self._verify_static_args(bs, n)  # padding rows only
                self._verify_graphs[(bs, n)] = self._capture_one(self._verify_fn, args, pool)
                self._verify_inputs[(bs, n)] = args[:7]
                pool = self._verify_graphs[(bs, n)][0].pool()
        torch.cuda.synchronize(self.device)

    def _verify_static_args(self, bs: int, n: int, batch: ForwardBatch | None = None) -> tuple:
        """Inputs of a (bs requests x n tokens) verify step: `batch`'s requests in the first rows, each
        padded to n tokens; padding tokens and rows are the decode padding (token 0, slot 0, KV writes to
        the sink page 0), so they compute garbage into the sinks and into window positions nobody folds."""
        dev, i64, i32 = self.device, torch.int64, torch.int32
        ids = torch.zeros(bs * n, dtype=i64, device=dev)
        loc = torch.zeros(bs * n, dtype=i64, device=dev)
        seq = torch.full((bs,), n, dtype=i32, device=dev)
        table = torch.zeros(bs, self.max_pages, dtype=i32, device=dev)
        slots = torch.zeros(bs, dtype=i64, device=dev)
        if batch is not None:
            b, lens = batch.batch_size, batch.extend_lens_cpu
            dst = torch.tensor([i * n + j for i, e in enumerate(lens) for j in range(e)], device=dev)
            ids[dst] = batch.input_ids
            loc[dst] = batch.out_cache_loc
            seq[:b] = torch.tensor([p + n for p in batch.prefix_lens_cpu], dtype=i32, device=dev)
            w = min(batch.page_table.shape[1], self.max_pages)
            table[:b, :w] = batch.page_table[:, :w]
            slots[:b] = batch.state_slots
        cu = torch.arange(0, bs * n + 1, n, dtype=i32, device=dev)
        rows = torch.arange(bs * n, dtype=i64, device=dev)
        c = self.cache
        return (ids, cu, seq, table, slots, loc, rows, c.ssm, c.conv, c.kv, *self._window.tensors())

    @torch.no_grad()
    def run_verify(self, batch: ForwardBatch) -> torch.Tensor:
        """A verify step (speculative decoding): anchor + drafts per request, logits for every token in
        the batch's order. The draft window set by `prepare_verify` receives what the commit needs."""
        if getattr(self, "_window", None) is None:
            raise ValueError("run_verify needs prepare_verify(window) first")
        if batch.mode != self._window.spec.step_mode:
            raise ValueError(f"run_verify takes {self._window.spec.step_mode!r} batches, got {batch.mode!r}")
        if batch.seq_lens_cpu and max(batch.seq_lens_cpu) > self.max_context:
            raise ValueError(f"a request's context ({max(batch.seq_lens_cpu)} tokens) exceeds this executor's "
                             f"max_context ({self.max_context})")
        b, n = batch.batch_size, max(batch.extend_lens_cpu)
        if n > self.max_verify_len:
            raise ValueError(f"verify batch of {n} tokens per request, the draft window holds {self.max_verify_len}")
        # every request is padded to n tokens; with padding on, the batch to its bucket too
        bs = (next_bucket(b, self.verify_buckets) if self.pad_to_buckets else None) or b
        if bs > self._window.rows:
            raise ValueError(f"verify batch of {bs} requests, the draft window has {self._window.rows} rows")
        args = self._verify_static_args(bs, n, batch)
        if (bs, n) in self._verify_graphs:
            graph, out = self._verify_graphs[(bs, n)]
            for dst, src in zip(self._verify_inputs[(bs, n)], args[:7]):
                dst.copy_(src)
            graph.replay()
        else:
            out = self._verify_fn(*args)
        logits = out[0] if isinstance(out, tuple) else out
        real = torch.tensor([i * n + j for i, e in enumerate(batch.extend_lens_cpu) for j in range(e)],
                            device=logits.device)
        return (logits[real], out[1][real]) if isinstance(out, tuple) else logits[real]


def emits_features(provider) -> bool:
    """Whether `provider`'s steps can also return target features (the eager model's `feature_layers`)."""
    if isinstance(provider, Mapping) or isinstance(getattr(provider, "graphs", None), Mapping):
        return False
    fn = getattr(provider, "step_tensors", None)
    return fn is not None and "feature_layers" in inspect.signature(fn).parameters


def _with_features(provider, mode: str, layers: tuple[int, ...]) -> StepFn:
    def fn(*args):
        return provider.step_tensors(mode, *args, feature_layers=layers)
    return fn


def _pools_alias(cache: CacheTensors) -> bool:
    ptrs = [t.untyped_storage().data_ptr() for t in (cache.ssm, cache.conv, cache.kv)]
    return len(set(ptrs)) < len(ptrs)


def _has_mode(provider, mode: str) -> bool:
    if isinstance(provider, Mapping):
        return mode in provider
    graphs = getattr(provider, "graphs", None)
    return mode in graphs if isinstance(graphs, Mapping) else hasattr(provider, "step_tensors")
