"""k3compile serve (MODEL|ENGINE_DIR | --model MODEL|ENGINE_DIR) [--host 127.0.0.1] [--port 30000] [engine flags]

An OpenAI-compatible HTTP server (see runtime/server/app.py). MODEL is a preset name or a
checkpoint directory; a directory holding engine.json is an engine built by `k3compile build`
(opened with its own dtype, page size, decode buckets and tokenizer). Positional or `--model`, as
vLLM takes it. Memory for KV + KDA state is sized from the device unless `--memory-bytes` says
(`--mem-fraction-static`, vLLM's `--gpu-memory-utilization` names the same); the sizes are logged.
The engine warms up before /health says OK (kernels compiled, decode graphs run); the time it took
is logged ("warm-up took ...").

A parallel engine (built with --topology) runs on all its ranks: the command starts one process
per rank itself, or, under torchrun, runs as the rank torchrun gives it (rank 0 serves, the others
execute its steps). `--topology` cuts a model (not an engine) into ranks at start-up. A rank that
dies or hangs (silent for --rank-timeout seconds) fails the requests in flight and shuts the server
down with an error naming the rank (exit code 1).
"""
from __future__ import annotations

import os
import sys

from .spec_flags import add_spec_flags, spec_kwargs


def register(sub) -> None:
    from k3compile.runtime.cache_policy import POLICIES as CACHE_POLICIES

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("model_positional", metavar="MODEL|ENGINE_DIR", nargs="?", default=None,
                   help="preset name, checkpoint directory, or engine directory (has engine.json)")
    p.add_argument("--model", dest="model_flag", metavar="MODEL|ENGINE_DIR", default=None,
                   help="the same, as a flag (give one of the two)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get("K3COMPILE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $K3COMPILE_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the preset name or the directory's name)")
    p.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: the engine's, else 16)")
    p.add_argument("--chunk-size", "--chunked-prefill-size", dest="chunk_size", type=int, default=256,
                   help="prefill chunk size in tokens (SGLang's --chunked-prefill-size)")
    p.add_argument("--max-batch-tokens", "--max-num-batched-tokens", dest="max_batch_tokens", type=int, default=2048,
                   help="token budget of one scheduler step, prefill chunks and decode tokens together "
                   "(vLLM's --max-num-batched-tokens)")
    p.add_argument("--no-mixed-batches", dest="mixed_batches", action="store_false",
                   help="keep prefill and decode in separate batches (default: decode tokens ride in prefill batches)")
    p.add_argument("--max-running", type=int, default=None,
                   help="most requests running at once (default: derived from the state pool)")
    p.add_argument("--max-context", type=int, default=None, help="cap on prompt + output tokens per request")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="weights dtype for a model (default fp32); an engine has the dtype it was built with")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--memory-bytes", type=int, default=None,
                   help="bytes for KV pages + KDA state slots (default: sized from the device)")
    p.add_argument("--mem-fraction-static", "--gpu-memory-utilization", dest="mem_fraction_static", type=float,
                   default=None, help="share of the GPU's memory for weights + KV + state (SGLang's name; vLLM's "
                   "--gpu-memory-utilization is the same flag here); on CPU the share of available RAM "
                   "(default: 0.85)")
    p.add_argument("--enable-unified-memory", dest="enable_unified_memory", action="store_true", default=None,
                   help="one arena for KV pages and state slots (the default unless --mamba-full-memory-ratio is "
                   "given)")
    p.add_argument("--disable-unified-memory", dest="enable_unified_memory", action="store_false", default=None,
                   help="split pools: a fixed share for KDA state slots, the rest KV pages (SGLang's layout)")
    p.add_argument("--mamba-full-memory-ratio", type=float, default=None,
                   help="split pools (giving it picks them): state : KV memory ratio, as in SGLang (default 0.9, "
                   "i.e. 47%% to state)")
    p.add_argument("--cache-policy", default="sparse", choices=list(CACHE_POLICIES),
                   help="which KDA states the prefix cache keeps and evicts (runtime/cache_policy.py): sparse "
                   "(chunk states at branch points and prompt tails, the default), valued (the same, evicted by "
                   "recompute saved per byte: fewer bytes), every_chunk, end, none")
    p.add_argument("--disable-prefix-cache", action="store_true", help="no radix cache / KDA checkpoints")
    p.add_argument("--overlap", dest="overlap", action="store_true", default=True,
                   help="prepare and launch batch N+1 while batch N runs (the default)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="run batches one after the other")
    p.add_argument("--engine-process", action="store_true",
                   help="build and step the engine in a child process (vLLM V1's EngineCore split): the HTTP side "
                   "and the engine's host work then share no GIL (runtime/server/engine_process.py); "
                   "/start_profile is not available there")
    p.add_argument("--step-timing", action="store_true",
                   help="time every decode forward on the device (CUDA events; the wall clock on a CPU) and export "
                   "the counts and seconds per batch bucket on /metrics (k3compile_decode_forwards_total, "
                   "k3compile_decode_forward_seconds_total): the served step next to `bench decode`'s. Off by "
                   "default: two event records per step")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the start-up warm-up (kernels then compile at the first requests)")
    p.add_argument("--topology", default=None,
                   help="a model only (an engine brings its own): serve it on tpN / dcpM / tpN-dcpM / tepN ranks, "
                   "cut at start-up")
    p.add_argument("--rank-timeout", dest="rank_timeout_s", type=float, default=60.0,
                   help="parallel engines: seconds a rank may stay silent before it counts as hung (default 60)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_spec_flags(p)
    p.set_defaults(func=run)
    return p


def model_source(args) -> str:
    """The model or engine directory, given positionally or as --model (exactly one of them)."""
    from k3compile.model_def.config import ConfigError

    given = [m for m in (args.model_positional, args.model_flag) if m is not None]
    if len(given) != 1:
        raise ConfigError("give the model or engine directory once: `serve MODEL` or `serve --model MODEL`"
                          if given else "which model? `serve MODEL` or `serve --model MODEL` (a preset, a "
                          "checkpoint directory or an engine directory)")
    return given[0]


def engine_args(args):
    """EngineArgs for the parsed flags; the model source picks model vs engine_dir."""
    from k3compile.engine.opened import is_engine_dir
    from k3compile.runtime.engine import EngineArgs
    from k3compile.runtime.memory.pools import state_fraction_from_ratio

    source = model_source(args)
    is_engine = is_engine_dir(source)
    kwargs = dict(model=None if is_engine else source, engine_dir=source if is_engine else None,
                  device=args.device, seed=args.seed, page_size=args.page_size, chunk_size=args.chunk_size,
                  max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                  memory_bytes=args.memory_bytes, enable_unified_memory=args.enable_unified_memory,
                  state_fraction=None if args.mamba_full_memory_ratio is None
                  else state_fraction_from_ratio(args.mamba_full_memory_ratio),
                  enable_prefix_cache=not args.disable_prefix_cache, overlap=args.overlap,
                  cache_policy=getattr(args, "cache_policy", EngineArgs.cache_policy),
                  mixed_batches=getattr(args, "mixed_batches", True),
                  max_context=args.max_context, mem_fraction_static=args.mem_fraction_static,
                  dtype=args.dtype,   # dtype None: fp32 for a model, the engine's own for an engine
                  topology=getattr(args, "topology", None), rank_timeout_s=getattr(args, "rank_timeout_s", 60.0),
                  step_timing=getattr(args, "step_timing", False))
    return EngineArgs(**kwargs, **spec_kwargs(args))


def served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    source = model_source(args)
    if os.path.isdir(source):
        return os.path.basename(os.path.normpath(os.path.abspath(source)))
    return source


def _log_to_stderr(name: str) -> None:
    import logging

    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("k3compile serve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def torchrun_worker(eargs) -> int | None:
    """Under torchrun, a non-zero rank of a parallel engine executes rank 0's steps (returns its exit
    code); None: this process serves."""
    from k3compile.model_def.config import ConfigError
    from k3compile.runtime.engine import _rank_source
    from k3compile.runtime.parallel.rank_worker import serve_rank

    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or rank == 0:
        return None
    source = _rank_source(eargs)
    if source is None:
        raise ConfigError("torchrun started several ranks, but this is not a parallel engine (build it with "
                          "--topology, or give --topology for a model)")
    return serve_rank(source, rank, eargs.device, eargs.rank_timeout_s)


def run(args) -> int:
    import functools

    from k3compile.model_def.config import ConfigError
    from k3compile.runtime.engine import LLMEngine

    for flag in ("port", "page_size", "chunk_size", "max_batch_tokens"):
        value = getattr(args, flag)
        if value is None:
            continue
        if value < (0 if flag == "port" else 1) or (flag == "port" and value > 65535):
            raise ConfigError(f"--{flag.replace('_', '-')} {value} is out of range")
    eargs = engine_args(args)
    code = torchrun_worker(eargs)
    if code is not None:
        return code
    if getattr(args, "engine_process", False):
        from k3compile.runtime.engine import _rank_source
        if _rank_source(eargs) is not None:
            raise ConfigError("--engine-process does not run parallel engines yet (their ranks are processes "
                              "of the serving process)")
    return serve_engine(functools.partial(LLMEngine, eargs), served_name(args), args)


def serve_engine(factory, name: str, args) -> int:
    """Build the engine with `factory()` (here, or in the engine process with --engine-process) and
    serve it until interrupted (args: host, port, api_key, log_level, warmup, engine_process). Also
    what `bench serve --stand-in` runs, with the engine's forward replaced (bench/serve_stand_in.py)."""
    import uvicorn

    from k3compile.model_def.config import ConfigError
    from k3compile.runtime.server.app import build_app
    from k3compile.runtime.server.async_engine import AsyncEngine
    from k3compile.runtime.server.edge import server_config

    _log_to_stderr("k3compile.server")   # the warm-up time and engine failures
    warmup = getattr(args, "warmup", True)
    if getattr(args, "engine_process", False):
        try:
            front = AsyncEngine.spawn(factory, warmup=warmup)
        except RuntimeError as e:
            raise ConfigError(str(e)) from None
    else:
        try:
            engine = factory()
        except ValueError as e:   # bad flag combinations the engine rejects: one line, like other input errors
            raise ConfigError(str(e)) from None
        front = AsyncEngine(engine, warmup=warmup)
    app = build_app(front, name, api_key=args.api_key)
    auth = "API key required" if args.api_key else "no API key"
    print(f"k3compile serve: {front.memory_summary}", flush=True)
    print(f"k3compile serve: '{name}' on http://{args.host}:{args.port}/v1 ({auth})", flush=True)
    server = uvicorn.Server(server_config(app, host=args.host, port=args.port, log_level=args.log_level))

    def stop_serving(err) -> None:   # a rank died or hung: requests failed already; stop taking new ones
        server.should_exit = True
    front.on_fatal = stop_serving
    try:
        server.run()
    finally:
        if front.engine is not None and hasattr(front.engine, "close"):
            front.engine.close()   # a parallel engine's ranks stop with it
    if front.fatal is not None:
        print(f"k3compile serve: shut down: {front.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0
