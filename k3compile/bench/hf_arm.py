"""Hugging Face transformers' KimiLinearForCausalLM as a decode-step anchor, in a process of its own.

    python -m k3compile.bench.hf_arm --model kimi-linear-48b --dtype bf16 --batch 1,8 --context 512 \\
        --device cuda --out hf.json

`k3compile bench ladder --hf` starts this before it loads its own model: at the Kimi-Linear-48B shape
each copy of the weights is ~98 GB, two do not fit on one H200, and a process that exits gives back
every byte (a model freed inside the bench's own process may stay pinned by CUDA graphs, Dynamo
caches or the caching allocator).

The model is what a user of transformers gets: `KimiLinearForCausalLM` from the same config
(`ModelConfig.to_hf_dict()`, as the HF parity tests build it: tests/model_def/test_hf_parity.py),
random weights from transformers' own initializer (std = initializer_range, the std of our presets'
random weights) in the bench dtype, its default experts implementation, fla's KDA kernels when fla
imports (transformers falls back to its PyTorch reference otherwise, as on CPU), no CUDA graphs.

Per batch size: prefill context-1 random tokens into transformers' own cache, then time decode steps
(one new token per request, `logits_to_keep=1`) with the docs/BENCHMARKS.md protocol: warm-up, then
`reps` x `steps` consecutive steps (CUDA events), median and p10/p90. Each step appends one token to
the cache, so the context grows from `context` by warmup + reps x steps tokens (recorded). Kernels per
step come from a torch.profiler trace of 2 steps (deleted after counting). Results are rewritten
after every batch size, so a run killed by its time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HF_ARM = "hf-transformers"
DESCRIPTION = "Hugging Face transformers KimiLinearForCausalLM (+ fla kernels when installed), own process"


def hf_config(source: str):
    """transformers' KimiLinearConfig for a preset name (random weights) or None for a checkpoint folder."""
    from k3compile.model_def.config import ConfigError, get_preset

    if os.path.isdir(source):
        return None
    cfg = get_preset(source)
    if cfg.is_k3:
        raise ConfigError(f"{source}: transformers has no K3 architecture (AttnRes, latent MoE); the Hugging Face "
                          f"anchor exists for Kimi-Linear configs only")
    from transformers import KimiLinearConfig
    return KimiLinearConfig(**cfg.to_hf_dict())


def build_hf_model(source: str, dtype, device, seed: int):
    import torch
    from transformers import KimiLinearForCausalLM

    config = hf_config(source)
    torch.manual_seed(seed)
    if config is None:
        model = KimiLinearForCausalLM.from_pretrained(source, dtype=dtype)
        model.to(device)
    else:
        with torch.device(device):  # weights are allocated and initialized on the device (no host copy of 98 GB)
            model = KimiLinearForCausalLM._from_config(config, dtype=dtype)
        if next(model.parameters()).device.type != device.type:  # a transformers version that ignores the context
            model.to(device)
    return model.eval()


def kernels_env() -> dict:
    """Which optional kernel packages transformers' kimi_linear could pick up in this process."""
    import importlib

    import transformers

    env = {"transformers": transformers.__version__}
    for name in ("fla", "causal_conv1d"):
        try:
            env[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except Exception:  # not installed, or a GPU-only package failing to import
            env[name] = None
    return env


def measure_batch(model, b: int, context: int, steps: int, warmup: int, reps: int, device, seed: int,
                  profile: bool = True) -> dict:
    import torch

    from .timing import profile_steps, summarize, sync, time_steps

    gen = torch.Generator().manual_seed(seed + b)
    prompt = torch.randint(3, model.config.vocab_size, (b, context - 1), generator=gen).to(device)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    sync(device)
    row = {"prefill_s": round(time.perf_counter() - t0, 2)}
    # transformers >= 5.24 names the cache `cache` (output field and argument); earlier 5.x `past_key_values`
    kw = "cache" if "cache" in out else "past_key_values"
    cache = out[kw]
    token = out.logits[:, -1:].argmax(-1)
    del out, prompt

    def step():
        return model(input_ids=token, use_cache=True, logits_to_keep=1, **{kw: cache}).logits

    row["first_step_ms"] = time_steps(step, 1, device)  # not timed below: first-call work (autotune, caches)
    row["warmup_ms"] = time_steps(step, warmup, device) if warmup else None
    row["samples_ms"] = [time_steps(step, steps, device) for _ in range(reps)]
    row.update(summarize(row["samples_ms"]), steps_per_rep=steps, status="ok")
    if profile:
        with tempfile.TemporaryDirectory() as tmp:
            counts = profile_steps(step, 2, device, os.path.join(tmp, "hf.json.gz"))
        counts.pop("trace", None)
        row.update(counts)
    row["context_first"], row["context_last"] = context, int(cache.get_seq_length())
    return row


def run(args) -> int:
    import torch

    from k3compile.model_def.config import ConfigError

    from .decode import _parse_ints
    from .results import environment, write_json

    batches = _parse_ints(args.batch, "--batch")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    t_start = time.perf_counter()
    deadline = t_start + args.time_budget if args.time_budget else None

    def log(msg):
        print(f"[hf {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    doc = {"arm": HF_ARM, "description": DESCRIPTION, "model": args.model, "dtype": args.dtype, "context": args.context,
           "batches": batches, "protocol": {"steps": args.steps, "warmup": args.warmup, "reps": args.reps},
           "kernels": kernels_env(), "environment": environment(device), "results": []}
    try:
        log(f"building transformers KimiLinearForCausalLM for {args.model} ({args.dtype}) on {device}")
        with torch.no_grad():
            model = build_hf_model(args.model, dtype, device, args.seed)
        doc["build_s"] = round(time.perf_counter() - t_start, 1)
        doc["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
        log(f"  built in {doc['build_s']} s; kernels {doc['kernels']}")
    except (ConfigError, ImportError, RuntimeError) as e:
        doc["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"  failed: {doc['error']}")
        write_json(args.out, doc)
        return 1
    for b in batches:
        if deadline is not None and time.perf_counter() > deadline:
            doc["results"].append({"batch": b, "status": "skipped", "reason": "hf arm time budget exhausted"})
            continue
        log(f"bs={b}: prefill {args.context - 1} tokens, then {args.warmup} + {args.reps} x {args.steps} decode steps")
        try:
            with torch.no_grad():
                row = measure_batch(model, b, args.context, args.steps, args.warmup, args.reps, device, args.seed)
        except Exception as e:  # e.g. out of memory at a large batch: the smaller batches' rows stand
            row = {"status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        row["batch"] = b
        doc["results"].append(row)
        log(f"  bs={b}: " + (f"{row['median_ms']:.2f} ms/step" if row.get("status") == "ok" else row["reason"]))
        write_json(args.out, doc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, doc)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3compile.bench.hf_arm", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Kimi-Linear preset (random weights) or checkpoint folder")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--batch", default="1")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--device", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; batch sizes that would start after it are skipped")
    p.add_argument("--out", required=True, help="JSON file for the results")
    return p


def command(model: str, dtype: str, batches: list[int], context: int, device: str, steps: int, warmup: int,
            reps: int, seed: int, time_budget: float | None, out: str) -> list[str]:
    """The command line bench ladder starts (this module under the same interpreter)."""
    cmd = [sys.executable, "-m", "k3compile.bench.hf_arm", "--model", model, "--dtype", dtype,
           "--batch", ",".join(map(str, batches)), "--context", str(context), "--device", device,
           "--steps", str(steps), "--warmup", str(warmup), "--reps", str(reps), "--seed", str(seed), "--out", out]
    return cmd + (["--time-budget", str(time_budget)] if time_budget else [])


if __name__ == "__main__":
    sys.exit(run(parser().parse_args()))
