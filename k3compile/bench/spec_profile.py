"""k3compile profile verify: the target's verify-step time per (batch size, verify tokens per request),
the marginal-cost surface the trim planner reads (issue 13, item 5).

    k3compile profile verify --engine engines/mini --batch 1,2,4,...,256 --tokens 8 --context 1024

For every batch bucket B and n = 1..N verify tokens per request, a verify step of B requests at context
`--context` is timed through the runtime's executor (CUDA graphs per (B, n) bucket on a GPU, as
serving runs them; eager elsewhere): mean ms over `--steps` back-to-back steps after a warm-up, CUDA
events on a GPU. The plain decode step (B requests, one token) is timed alongside for reference.
Pools hold random values; a verify step reads the committed state and rewrites the same KV rows and
window, so every repetition does the same work.

Writes OUT/<device>__<model>.json (runtime/spec/cost_profile.py format; meta: decode_ms, marginal_ms,
context, environment), a markdown table and a PNG plot of T(B, n) and of the marginal cost per added
token. Default OUT: profiles/.
"""
from __future__ import annotations

import os
import time

import torch

from k3compile.bench.results import environment
from k3compile.bench.timing import time_steps
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
from k3compile.runtime.executor import Executor
from k3compile.runtime.spec.cost_profile import CostProfile, profile_name


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _random_pools(cache: CacheTensors, seed: int) -> None:
    gen = torch.Generator(device=cache.kv.device).manual_seed(seed)
    for t, scale in ((cache.ssm, 0.1), (cache.conv, 1.0), (cache.kv, 1.0)):
        t.copy_((torch.randn(t.shape, generator=gen, device=t.device) * scale).to(t.dtype))


def measure(provider, batches: list[int], max_tokens: int, context: int, steps: int, warmup: int,
            page_size: int = 16, window_kind: str = "replay", cuda_graphs: bool | None = None,
            seed: int = 0, log=print) -> CostProfile:
    dev = torch.device(getattr(provider, "device", None) or next(provider.parameters()).device)
    spec = provider.cache_spec()
    bmax = max(batches)
    pages = -(-(context + max_tokens) // page_size)
    cache = CacheTensors.allocate(spec, bmax + 1, bmax * pages + 1, page_size, device=dev)
    _random_pools(cache, seed)
    t0 = time.perf_counter()
    ex = Executor(provider, cache, cuda_graphs=cuda_graphs, buckets=batches, max_context=context + max_tokens)
    window = DraftWindow.allocate(DraftWindowSpec(spec, max_tokens, window_kind), bmax, device=dev)
    ex.prepare_verify(window, max_tokens)
    log(f"executor ready ({'CUDA graphs' if ex.cuda_graphs else 'eager'}, {time.perf_counter() - t0:.1f}s)")
    rows = [[1 + r * pages + j for j in range(pages)] for r in range(bmax)]
    step_ms, decode_ms = [], []
    for b in batches:
        tables, slots = rows[:b], list(range(1, b + 1))
        dec = ForwardBatch.build("decode", [[1]] * b, [context] * b, tables, slots, page_size, device=dev)
        decode_ms.append(_time(lambda: ex.run(dec), steps, warmup, dev))
        row = []
        for n in range(1, max_tokens + 1):
            vb = ForwardBatch.build(window.spec.step_mode, [[1] * n] * b, [context] * b, tables, slots, page_size,
                                    device=dev, logits="all")
            row.append(_time(lambda: ex.run_verify(vb), steps, warmup, dev))
        step_ms.append(row)
        log(f"batch {b}: decode {decode_ms[-1]:.3f} ms; verify " + " ".join(f"{x:.3f}" for x in row) + " ms")
    marginal = [[r[0] - d] + [r[i] - r[i - 1] for i in range(1, len(r))] for r, d in zip(step_ms, decode_ms)]
    model = getattr(provider.config, "name", "model")
    return CostProfile(device_name(dev), model, list(batches), list(range(1, max_tokens + 1)), step_ms,
                       meta={"context": context, "page_size": page_size, "steps": steps, "warmup": warmup,
                             "window": window_kind, "cuda_graphs": ex.cuda_graphs, "decode_ms": decode_ms,
                             "marginal_ms": marginal, "environment": environment(dev)})


def _time(fn, steps: int, warmup: int, dev: torch.device) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        return time_steps(fn, steps, dev)


def markdown(p: CostProfile) -> str:
    ts = p.verify_tokens
    lines = [f"# verify step time, {p.model} on {p.device} (context {p.meta.get('context')})", "",
             "ms per step; n = verify tokens per request (anchor + drafts); decode = the plain decode step", "",
             "| batch | decode | " + " | ".join(f"n={t}" for t in ts) + " |",
             "|---:|---:|" + "---:|" * len(ts)]
    for b, row, d in zip(p.batch_sizes, p.step_ms, p.meta.get("decode_ms", [float("nan")] * len(p.batch_sizes))):
        lines.append(f"| {b} | {d:.3f} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    lines += ["", "marginal ms of the n-th token per request (n=1: verify of the anchor alone minus decode)", "",
              "| batch | " + " | ".join(f"n={t}" for t in ts) + " |", "|---:|" + "---:|" * len(ts)]
    for b, row in zip(p.batch_sizes, p.meta.get("marginal_ms", [])):
        lines.append(f"| {b} | " + " | ".join(f"{x:+.3f}" for x in row) + " |")
    return "\n".join(lines) + "\n"


def plot(p: CostProfile, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n_i, n in enumerate(p.verify_tokens):
        a.plot(p.batch_sizes, [r[n_i] for r in p.step_ms], marker="o", label=f"n={n}")
        b.plot([bs * n for bs in p.batch_sizes], [r[n_i] for r in p.step_ms], marker=".", label=f"n={n}")
    for ax, xl in ((a, "batch size"), (b, "verify tokens in the step (batch x n)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xl)
        ax.set_ylabel("step ms")
        ax.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle(f"verify step time: {p.model} on {p.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(p: CostProfile, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, profile_name(p.device, p.model))
    p.save(base)
    stem = base[: -len(".json")]
    with open(stem + ".md", "w") as f:
        f.write(markdown(p))
    plot(p, stem + ".png")
    return base
