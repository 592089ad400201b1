"""k3compile serve MODEL|ENGINE_DIR [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine flags]

An OpenAI-compatible HTTP server (see runtime/server/app.py). MODEL is a preset name or a
checkpoint directory; a directory holding engine.json is an engine built by `k3compile build`.
"""
from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("model", metavar="MODEL|ENGINE_DIR",
                   help="preset name, checkpoint directory, or engine directory (has engine.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get("K3COMPILE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $K3COMPILE_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the preset name or the directory's name)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk size (tokens)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget of one scheduler step")
    p.add_argument("--max-running", type=int, default=None,
                   help="most requests running at once (default: derived from the state pool)")
    p.add_argument("--max-context", type=int, default=None, help="cap on prompt + output tokens per request")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="weights dtype for a model (default fp32); an engine has the dtype it was built with")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--memory-bytes", type=int, default=None, help="bytes for KV pages + KDA state slots")
    p.add_argument("--enable-unified-memory", action="store_true",
                   help="one arena for KV pages and state slots instead of split pools")
    p.add_argument("--mamba-full-memory-ratio", type=float, default=None,
                   help="split pools only: state : KV memory ratio, as in SGLang (default 0.9, i.e. 47%% to state)")
    p.add_argument("--disable-prefix-cache", action="store_true", help="no radix cache / KDA checkpoints")
    p.add_argument("--overlap", action="store_true", help="prepare batch N+1 while batch N runs")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)
    return p


def engine_args(args):
    """EngineArgs for the parsed flags; the positional picks model vs engine_dir."""
    from k3compile.runtime.engine import EngineArgs
    from k3compile.runtime.memory.pools import state_fraction_from_ratio

    is_engine = os.path.isdir(args.model) and os.path.isfile(os.path.join(args.model, "engine.json"))
    kwargs = dict(model=None if is_engine else args.model, engine_dir=args.model if is_engine else None,
                  device=args.device, seed=args.seed, page_size=args.page_size, chunk_size=args.chunk_size,
                  max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                  memory_bytes=args.memory_bytes, enable_unified_memory=args.enable_unified_memory,
                  state_fraction=None if args.mamba_full_memory_ratio is None
                  else state_fraction_from_ratio(args.mamba_full_memory_ratio),
                  enable_prefix_cache=not args.disable_prefix_cache, overlap=args.overlap,
                  max_context=args.max_context)
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    elif is_engine:   # an engine runs in the dtype it was built for
        kwargs["dtype"] = _engine_dtype(args.model)
    return EngineArgs(**kwargs)


def _engine_dtype(engine_dir: str) -> str:
    import json

    from k3compile.engine.format import MANIFEST, EngineError

    path = os.path.join(engine_dir, MANIFEST)
    try:
        with open(path) as f:
            dtype = json.load(f).get("dtype")
    except (OSError, ValueError, AttributeError) as e:
        raise EngineError(f"{path}: cannot read the engine manifest ({e})") from None
    if not isinstance(dtype, str):
        raise EngineError(f"{path}: the manifest has no 'dtype'")
    return dtype


def served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if os.path.isdir(args.model):
        return os.path.basename(os.path.normpath(os.path.abspath(args.model)))
    return args.model


def run(args) -> int:
    import uvicorn

    from k3compile.model_def.config import ConfigError
    from k3compile.runtime.engine import LLMEngine
    from k3compile.runtime.server.app import build_app
    from k3compile.runtime.server.async_engine import AsyncEngine

    for flag in ("port", "page_size", "chunk_size", "max_batch_tokens"):
        value = getattr(args, flag)
        if value < (0 if flag == "port" else 1) or (flag == "port" and value > 65535):
            raise ConfigError(f"--{flag.replace('_', '-')} {value} is out of range")
    try:
        engine = LLMEngine(engine_args(args))
    except ValueError as e:   # bad flag combinations the engine rejects: one line, like other input errors
        raise ConfigError(str(e)) from None
    name = served_name(args)
    app = build_app(AsyncEngine(engine), name, api_key=args.api_key)
    auth = "API key required" if args.api_key else "no API key"
    print(f"k3compile serve: '{name}' on http://{args.host}:{args.port}/v1 ({auth})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
