"""Batch-1 decode budget per kernel kind (issue 9): the bytes each kernel must move, its floor at the copy
bandwidth, and (given a `k3compile report --json` of the engine's trace) the measured microseconds beside it.

    python tools/decode_budget.py k3-mini-6b [--report traces/h200_s12/call4/report_all3.json]
                                  [--bandwidth 4.24e12] [--step-ms 1.833] [--context 512]
                                  [--ladder LADDER.json [--arm v-NAME]]

Bytes come from the preset's parameters on the meta device, grouped by the kernel of the engine's default
pipeline that reads them (tools/kernels_per_layer.py's inventory: 288 kernels a step for k3-mini-6b): the
weights a kernel streams, plus the cache bytes it must touch at batch 1 (KDA: the fp32 state read and written,
MLA: `context` rows of latent KV read). Routed experts: top-k distinct experts per MoE layer (what
k3compile/bench/roofline.py assumes at batch 1). Small reads (norm vectors, AttnRes banks, activations) are
left out: they come from L2 or are < 0.1 us each, so a kernel whose bytes are ~0 has a floor of ~0 and its
time is all latency.

With --report: the measured mean per launch of the kernel names that map to one kind (the GEMVs share one
kernel name, so their per-shape times are not in a report: they are shown as one group). Kernel durations in a
trace of an engine with PDL early release include the time a kernel sits resident in gdc_wait (o_proj during
the fused KDA kernel, B' during kernel A), so the measured column over-counts those kinds; the step time
(--step-ms, from the ladder) is the measure that sums.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

import torch

from k3compile.model_def.config import get_preset

COPY_BW = 4.24e12  # bytes/s: the H200's same-run copy bandwidth in the session-12 ladders (4.20-4.24 TB/s)


@dataclass
class Kind:
    name: str          # what the kernel is
    kernel: str        # the kernel's name in a profiler trace ('' where several kinds share one)
    count: int         # launches per decode step
    bytes: int         # bytes per launch (see module doc)


def _weights(cfg) -> dict[str, int]:
    """{parameter name with the layer index replaced by N, layer kind: bytes of one layer's copy}"""
    from k3compile.model_def.loader import build_model
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.bfloat16)
    out: dict[tuple[str, str], int] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        kind = cfg.layer_types[int(m.group(1))] if m else "-"
        key = (kind, m.group(2) if m else name)
        out[key] = max(out.get(key, 0), t.numel() * t.element_size())
    return out


def kinds(cfg, context: int) -> list[Kind]:
    w = _weights(cfg)
    bf = 2

    def wb(kind, *names):
        return sum(w[(kind, n)] for n in names)

    kda, mla = len(cfg.kda_layers), len(cfg.mla_layers)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense = cfg.num_hidden_layers - moe
    lt = cfg.layer_types
    moe_kind = lt[next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))]
    sa = "self_attn."
    expert = (w[(moe_kind, "block_sparse_moe.experts.w13")] // cfg.num_experts,
              w[(moe_kind, "block_sparse_moe.experts.w2")] // cfg.num_experts)
    k = cfg.num_experts_per_token
    state = 2 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4  # fp32 state read + written
    kv_row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * bf
    nope, dv, h = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_attention_heads
    w_uk = h * nope * cfg.kv_lora_rank * bf
    w_uv = h * dv * cfg.kv_lora_rank * bf
    moe_front = ("block_sparse_moe.routed_expert_down_proj.weight", "block_sparse_moe.shared_experts.gate_proj.weight",
                 "block_sparse_moe.shared_experts.up_proj.weight")
    kernel_c = ("block_sparse_moe.routed_expert_up_proj.weight", "block_sparse_moe.shared_experts.down_proj.weight")
    return [
        Kind("KDA in_proj GEMV (q k v g f_a b)", "", kda,
             wb("kda", *(sa + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")))),
        Kind("fused KDA (fp32 state r+w, f_b)", "_fused_kda_decode_kernel", kda,
             state + wb("kda", sa + "f_b_proj.weight")),
        Kind("KDA o_proj GEMV", "", kda, wb("kda", sa + "o_proj.weight")),
        Kind("MLA input GEMV (q_a kv_a g)", "", mla,
             wb("mla", *(sa + p + ".weight" for p in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")))),
        Kind("MLA prologue + W_UK absorb", "_prologue_absorb_kernel", mla, w_uk + kv_row),
        Kind("MLA q_b norm_gemv", "_norm_gemv_kernel", mla, wb("mla", sa + "q_b_proj.weight")),
        Kind("MLA decode split (KV pages)", "_decode_split_kernel", mla, context * kv_row),
        Kind("MLA merge + W_UV + gate", "_decode_merge_out_cols_kernel", mla, w_uv),
        Kind("MLA o_proj GEMV", "", mla, wb("mla", sa + "o_proj.weight")),
        Kind("AttnRes norm (each layer, dense MLP, final)", "_attn_res_norm_tile_kernel", cfg.num_hidden_layers + dense + 1, 0),
        Kind("norm_route (router)", "_norm_route_kernel", moe, wb(moe_kind, "block_sparse_moe.gate.weight")),
        Kind("MoE front GEMV (latent down, shared gate/up)", "", moe, wb(moe_kind, *moe_front)),
        Kind(f"MoE A (top-{k} W13)", "_expert_up_rows_kernel", moe, k * expert[0]),
        Kind(f"MoE B' (top-{k} W2)", "_expert_down_split_kernel", moe, k * expert[1]),
        Kind("MoE C (latent norm + up, shared down)", "_latent_out_kernel", moe, wb(moe_kind, *kernel_c)),
        Kind("dense gate/up GEMV", "", dense, wb(lt[0], "mlp.gate_proj.weight", "mlp.up_proj.weight")),
        Kind("dense GLU act", "_glu_act_kernel", dense, 0),
        Kind("dense down GEMV", "", dense, wb(lt[0], "mlp.down_proj.weight")),
        Kind("lm_head GEMV", "", 1, w[("-", "lm_head.weight")]),
        Kind("embedding rows, logits cast to fp32", "", 2, cfg.vocab_size * 4),
    ]


def measured(report: dict) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches per step, mean us)} from a `k3compile report --json`."""
    steps = len(report["steps"]) or 1
    return {t["name"]: (t["count"] / steps, t["mean_us"]) for t in report["top_kernels"]}


def p8_choices(ladder: dict) -> list[dict]:
    """P8's build-time decisions in a ladder JSON (the first rung's pass report that has them): per (N, K) the GEMVs
    a step, the chosen configuration and its M = 1 microseconds (P8's own timing: a PDL chain over weight copies
    that overflow L2, tools/bench_gemv.py --p8), and cuBLAS's."""
    def walk(o):
        if isinstance(o, dict):
            if o.get("name") == "p08_small_m_gemm" and o.get("details", {}).get("nodes"):
                yield o["details"]
            for v in o.values():
                yield from walk(v)
        elif isinstance(o, list):
            for v in o:
                yield from walk(v)
    details = next(walk(ladder), None)
    out: dict[tuple, dict] = {}
    for n in (details or {}).get("nodes", []):
        key = (n["N"], n["K"])
        if key in out:
            out[key]["count"] += 1
            continue
        cfg, us = n.get("config"), n.get("us", {}).get("1", {})
        label = (f"{cfg['block_n']}x{cfg['block_k']}x{cfg['split_k']}x{1 if cfg['design'] == 'rows' else 0} "
                 f"w{cfg['num_warps']}") if cfg else "cublas"
        out[key] = {"N": key[0], "K": key[1], "count": 1, "config": label, "cublas_us": us.get("cublas"),
                    "us": us.get("gemv", {}).get(label, us.get("cublas"))}
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset")
    ap.add_argument("--report", help="a `k3compile report --json` of the engine's batch-1 trace")
    ap.add_argument("--bandwidth", type=float, default=COPY_BW, help="bytes/s for the floors")
    ap.add_argument("--step-ms", type=float, help="the measured step (ladder), for the summary")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ladder", help="a `bench ladder` JSON: engine-after's batch-1 step and the same-run copy "
                                     "bandwidth (unless --step-ms / --bandwidth say otherwise)")
    ap.add_argument("--arm", default="engine-after", help="with --ladder: the arm whose step to use")
    a = ap.parse_args()
    if a.ladder:
        lad = json.load(open(a.ladder))
        arm = lad["anchors"].get(a.arm, a.arm)
        row = next((r for r in lad["results"] if r["arm"] == arm and r["batch"] == 1 and "median_ms" in r), None)
        if a.step_ms is None and row is not None:
            a.step_ms = row["median_ms"]
        if a.bandwidth == COPY_BW:
            a.bandwidth = lad["copy_bandwidth"]["bytes_per_s"]
        print(f"{a.ladder}: {arm} batch 1 {a.step_ms} ms, copy bandwidth {a.bandwidth / 1e9:.0f} GB/s\n")
    cfg = get_preset(a.preset)
    rows = kinds(cfg, a.context)
    meas = measured(json.load(open(a.report))) if a.report else {}
    bw = a.bandwidth
    print(f"| kernel kind | per step | MB / launch | floor us / launch | measured us / launch | floor us / step |")
    print("|---|---:|---:|---:|---:|---:|")
    tot_b = tot_n = 0
    for r in rows:
        m = meas.get(r.kernel) if r.kernel else None
        ms = f"{m[1]:.2f}" if m else "-"
        print(f"| {r.name} | {r.count} | {r.bytes / 1e6:.2f} | {r.bytes / bw * 1e6:.2f} | {ms} | "
              f"{r.count * r.bytes / bw * 1e6:.1f} |")
        tot_b += r.count * r.bytes
        tot_n += r.count
    floor_us = tot_b / bw * 1e6
    print(f"| **total** | {tot_n} | {tot_b / tot_n / 1e6:.2f} (mean) | | | **{floor_us:.0f}** |")
    gemv = meas.get("_gemv_rows_kernel")
    if gemv:
        print(f"\nGEMVs in the trace: {gemv[0]:.0f} a step, mean {gemv[1]:.2f} us (one kernel name for every shape)")
    choices = p8_choices(lad) if a.ladder else []
    if choices:
        print("\nP8's choices at build (M = 1, its own PDL-chain timing over L2-overflowing weight copies):\n")
        print("| N x K | GEMVs a step | MB | config | us | GB/s | % of copy bw | over floor us | cuBLAS us |")
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for c in choices:
        nbytes = 2 * c["N"] * c["K"]
        if c["us"]:
            print(f"| {c['N']} x {c['K']} | {c['count']} | {nbytes / 1e6:.1f} | {c['config']} | {c['us']:.2f} | "
                  f"{nbytes / c['us'] / 1e3:.0f} | {100 * nbytes / (c['us'] * 1e-6) / bw:.0f}% | "
                  f"{c['us'] - nbytes / bw * 1e6:.2f} | {c['cublas_us']} |")
    if a.step_ms:
        step = a.step_ms * 1e3
        print(f"\nstep {step:.0f} us = floor {floor_us:.0f} us ({100 * floor_us / step:.1f}% of the roofline) "
              f"+ {step - floor_us:.0f} us over it, {(step - floor_us) / tot_n:.2f} us per kernel over {tot_n} kernels")
        goal = floor_us / 0.7
        print(f"70% = {goal:.0f} us: {goal - floor_us:.0f} us over the floor for the whole step; at 1.4 us of launch "
              f"and latency per kernel that is {(goal - floor_us) / 1.4:.0f} kernels with every kernel at the copy "
              f"bandwidth; at {tot_n} kernels, {(goal - floor_us) / tot_n:.2f} us over its floor per kernel")


if __name__ == "__main__":
    main()
