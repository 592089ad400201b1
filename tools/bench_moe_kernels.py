"""Old vs new fused MoE decode kernels, per kernel, against a same-run copy bandwidth (issue 9; run by
tools/gpu_moe3.sh on CUDA).

Shapes: one MoE layer of Kimi-Linear-48B (E=256, top-8, D=2304, I=1024, one shared expert) and of
k3-mini-6b (E=96, top-8, experts on the 1024-wide latent, I=512, RMSNorm + up-projection to 2048, two
shared experts' worth of shared width, SiTU). Experts in bf16 and MXFP4; batch 1, 8, 64; uniformly random
distinct experts per token (kernels.moe_decode.random_routing).

Per arm ("before": tools/moe_kernels_before.py, the kernels as they were; "after": kernels.moe_decode):
  * op_us: the whole op replayed from a CUDA graph (kernels.moe_decode._time_us), launch gaps included;
  * per kernel: its mean device time from torch.profiler over eager calls, and its GB/s =
    bytes it must move / time, and that as % of the copy bandwidth measured first in this process
    (k3compile.bench.timing.copy_bandwidth, 1 GiB). Bytes: the distinct experts' rows the kernel reads
    (bf16: 2 B per weight; MXFP4: 0.5 B + 1/32 B of scale), the shared expert / latent up-projection's
    weights, activations in and out (h is fp32).
  * rel_err of both arms against the fp32 reference (fused_moe_reference on upcast inputs).
"after" is what the op serves: kernels.moe_decode.fused_moe_triton with its kernel_designs() dispatch (the
"rows" kernels are reported under the same kernel names). With MOE_TILE_SWEEP=1 in the environment, a small
tile sweep of the "tiles" down and up kernels (TUNED entries set one at a time, "tiles" design forced) at the
48B shape follows: bf16 at batch 1 and 8, MXFP4 at batch 1 (off by default: the run stays under a minute).
Prints a table; writes moe_kernels.json and moe_kernels.md to OUT (argv[1]).
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch

from k3compile.bench.timing import copy_bandwidth
from k3compile.model_def.config import get_preset
from k3compile.model_def.ops import mxfp4
from k3compile.passes.kernels import moe_decode, moe_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_kernels_before  # noqa: E402

BATCHES = (1, 8, 64)


def kernel_times(fn, iters: int = 20) -> dict[str, float]:
    """Mean device µs per call of each kernel `fn` launches (eager, after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            # one name per kernel role: the "rows" and "split" designs count as the kernel they stand in for
            total[evt.name.replace("_rows_kernel", "_kernel").replace("_split_kernel", "_kernel")] += evt.device_time
    return {name: us / iters for name, us in total.items()}


def layer(name: str, gen) -> dict:
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    cfg = get_preset(name)
    e, k, i = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    s = i * cfg.num_shared_experts
    latent = getattr(cfg, "latent_size", None)
    d_in = latent or cfg.hidden_size  # the experts' width
    w13, w2 = randn(e, 2 * i, d_in, scale=d_in ** -0.5), randn(e, d_in, i, scale=i ** -0.5)
    spec = dict(name=name, e=e, k=k, i=i, s=s, d_in=d_in, d_out=cfg.hidden_size, w13=w13, w2=w2,
                shared_w2=randn(cfg.hidden_size, s, scale=s ** -0.5), act="situ" if latent else "silu")
    if latent:
        spec.update(up_w=randn(cfg.hidden_size, latent, scale=latent ** -0.5), norm_w=randn(latent) * 0.1 + 1)
    spec["mxfp4"] = (*mxfp4.quantize(w13), *mxfp4.quantize(w2))  # w13 codes, scales, w2 codes, scales
    return spec


def kernel_bytes(spec: dict, n: int, touched: int, quant: bool) -> dict[str, float]:
    """Bytes each kernel must move at batch n (see the module doc)."""
    per_weight = 0.5 + 1 / 32 if quant else 2.0
    e_rows = spec["i"] * spec["d_in"]  # one expert's gate (or up, or down) matrix
    h = n * spec["k"] * spec["i"] * 4
    up = touched * 2 * e_rows * per_weight + n * spec["d_in"] * 2 + h
    shared = spec["d_out"] * spec["s"] * 2 + n * spec["s"] * 4
    if "up_w" in spec:
        down = touched * e_rows * per_weight + h + n * spec["d_in"] * 4
        latent = spec["d_out"] * spec["d_in"] * 2 + shared + n * spec["d_in"] * 4 + n * spec["d_out"] * 2
        return {"_expert_up_kernel": up, "_expert_down_kernel": down, "_latent_out_kernel": latent}
    return {"_expert_up_kernel": up, "_expert_down_kernel": touched * e_rows * per_weight + h + shared
            + n * spec["d_out"] * 2}


def kernel_rows(nbytes: dict[str, float], times: dict[str, float], bandwidth: float) -> dict[str, dict]:
    """Per kernel: µs, MB it must move, GB/s and % of the copy bandwidth (GB/s)."""
    rows = {}
    for name, b in nbytes.items():
        us = times.get(name, float("nan"))
        rows[name] = dict(us=round(us, 2), mbytes=round(b / 1e6, 2), gbps=round(b / us / 1e3, 1),
                          pct=round(100 * b / us / 1e3 / bandwidth, 1))
    return rows


def op_args(spec: dict, n: int, quant: bool, gen) -> tuple[tuple, dict]:
    ids, wts = moe_decode.random_routing(n, spec["e"], spec["k"], "cuda", seed=n)
    x = torch.randn(n, spec["d_in"], generator=gen, device="cuda").bfloat16()
    g, u = (torch.randn(n, spec["s"], generator=gen, device="cuda").bfloat16() for _ in range(2))
    w13, w2, s13, s2 = spec["w13"], spec["w2"], None, None
    if quant:
        w13, s13, w2, s2 = spec["mxfp4"]
    kw = dict(act=spec["act"], beta=4.0, linear_beta=25.0)
    if "up_w" in spec:
        kw.update(latent_up_w=spec["up_w"], latent_norm_w=spec["norm_w"], latent_eps=1e-5)
    return (x, ids, wts, w13, w2, s13, s2, g, u, spec["shared_w2"]), kw


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(f"{((got.float() - ref).abs().max() / ref.abs().max()).item():.3g}")


def bench_arms(spec, bandwidth, gen, rows):
    for quant in (False, True):
        for n in BATCHES:
            args, kw = op_args(spec, n, quant, gen)
            touched = int(args[1].unique().numel())
            up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t  # noqa: E731
            ref = moe_decode.fused_moe_reference(*map(up, args), **{key: up(v) for key, v in kw.items()}).float()
            nbytes = kernel_bytes(spec, n, touched, quant)
            for arm, run in (("before", moe_kernels_before.fused_moe_triton), ("after", moe_decode.fused_moe_triton)):
                fn = (lambda: run(*args, **kw))
                op_us = moe_decode._time_us(fn, iters=50)
                times = kernel_times(fn)
                row = dict(shape=spec["name"], experts="mxfp4" if quant else "bf16", batch=n, arm=arm,
                           touched=touched, op_us=round(op_us, 2), rel_err=rel_err(fn(), ref),
                           op_gbps=round(sum(nbytes.values()) / op_us / 1e3, 1),
                           op_pct=round(100 * sum(nbytes.values()) / op_us / 1e3 / bandwidth, 1),
                           kernels=kernel_rows(nbytes, times, bandwidth))
                rows.append(row)
                print(json.dumps(row), flush=True)


# (BLOCK_N, BLOCK_K, num_warps) tried per (kernel, MXFP4); the rule's choice at the 48B shape is the first of each
# (bf16 down: its tile spans all 8 experts, so BLOCK_N x BLOCK_K is an eighth of the up kernel's)
SWEEP = {("down", False): [(4, 256, 4), (8, 128, 4), (8, 256, 8), (16, 64, 4), (4, 512, 8)],
         ("up", False): [(8, 512, 4), (16, 256, 4), (8, 256, 4), (4, 1024, 4), (16, 512, 8)],
         ("down", True): [(4, 1024, 4), (8, 1024, 4), (8, 512, 4), (4, 512, 4), (16, 512, 8)],
         ("up", True): [(8, 512, 4), (16, 256, 4), (8, 256, 4), (4, 1024, 4)]}


def tile_sweep(spec, bandwidth, gen) -> list[dict]:
    out = []
    for quant, n in ((False, 1), (False, 8), (True, 1)):  # a short sweep: the GPU call has ~3 minutes
        args, kw = op_args(spec, n, quant, gen)
        touched = int(args[1].unique().numel())
        nbytes = kernel_bytes(spec, n, touched, quant)
        for kernel in ("down", "up"):
            configs = SWEEP[(kernel, quant)]
            name = f"_expert_{kernel}_kernel"
            key = (kernel, n * spec["k"], spec["i"], spec["d_in"], quant) if kernel == "up" else \
                (kernel, n, spec["d_in"], spec["i"], quant)
            rule = moe_launch.gemv_config(*key, top_k=spec["k"])
            saved = moe_launch.TUNED.get(key)
            for cfg in configs:
                bn, bk, warps = cfg
                moe_launch.TUNED[key] = (bn, bk, warps)
                try:
                    us = kernel_times(lambda: moe_decode.fused_moe_triton(*args, **kw, designs=("tiles", "tiles")),
                                      iters=10)[name]
                finally:
                    moe_launch.TUNED.pop(key)
                    if saved is not None:
                        moe_launch.TUNED[key] = saved
                out.append(dict(experts="mxfp4" if quant else "bf16", batch=n, kernel=kernel,
                                config=[bn, bk, warps], rule=list(rule), us=round(us, 2),
                                pct=round(100 * nbytes[name] / us / 1e3 / bandwidth, 1)))
            best = min((r for r in out if r["batch"] == n and r["kernel"] == kernel
                        and r["experts"] == ("mxfp4" if quant else "bf16")), key=lambda r: r["us"])
            print(f"sweep {best['experts']} batch {n} {kernel}: best {best['config']} {best['us']} us "
                  f"({best['pct']}%), rule {list(rule)}", flush=True)
    return out


def save_report(out_dir: str, stem: str, markdown: str, payload: dict) -> None:
    """OUT/<stem>.md (the table) and OUT/<stem>.json (every row): what the MoE benches write after each arm."""
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=1)


def bench_setup() -> tuple[dict, float, torch.Generator]:
    """Exact fp32 GEMMs; the same-run copy bandwidth (its record, and GB/s, printed); a seeded CUDA generator."""
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth(1 << 30, torch.device("cuda"))
    bandwidth = bw["bytes_per_s"] / 1e9
    print(f"copy bandwidth {bandwidth:.1f} GB/s", flush=True)
    return bw, bandwidth, torch.Generator(device="cuda").manual_seed(0)


def main(out_dir: str) -> None:
    bw, bandwidth, gen = bench_setup()
    rows, sweep = [], []
    for name in ("kimi-linear-48b", "k3-mini-6b"):
        spec = layer(name, gen)
        with torch.no_grad():
            bench_arms(spec, bandwidth, gen, rows)
            if name == "kimi-linear-48b" and os.environ.get("MOE_TILE_SWEEP") == "1":
                sweep = tile_sweep(spec, bandwidth, gen)
        del spec
        torch.cuda.empty_cache()
    lines = [f"copy bandwidth (same run): {bandwidth:.1f} GB/s; {torch.cuda.get_device_name()}", "",
             "| shape | experts | batch | arm | op µs (graph) | op % bw | kernel | µs | MB | GB/s | % bw | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for kname, kv in r["kernels"].items():
            lines.append(f"| {r['shape']} | {r['experts']} | {r['batch']} | {r['arm']} | {r['op_us']} | {r['op_pct']} | "
                         f"{kname.strip('_')} | {kv['us']} | {kv['mbytes']} | {kv['gbps']} | {kv['pct']} | "
                         f"{r['rel_err']} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "moe_kernels.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, "moe_kernels.json"), "w") as f:
        json.dump({"copy_bandwidth": bw, "rows": rows, "tile_sweep": sweep}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
