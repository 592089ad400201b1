"""Kernels per decode layer, by kind, after the pass pipeline: what stands between a model and the
issue-9 goal of <= 8 kernels per layer.

    python tools/kernels_per_layer.py k3-mini-6b [--tiny-dims] [--passes all|none|p01,...] [--json FILE]

The step graph is captured on CPU (bf16 decode) and passed; each node's launches are
`passes.launches.node_launches` (one per compute node) except the k3 ops that launch more than one
kernel on CUDA (`MULTI_KERNEL_OPS`, from the H200 trace); the layer is `engine.provenance`'s. With
`--tiny-dims` the preset keeps its layer structure (layer types, MoE layers, AttnRes block size,
layer count) on k3-tiny's widths, so a 6B preset counts in seconds on a CPU: the node structure
does not depend on widths, but a pass whose choice depends on a shape (a kernel's size limit) may
choose differently there. cuBLAS's split-K reduce (a second kernel for some GEMM shapes on the GPU)
is not in the graph and not counted.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch

from k3compile.capture import capture_step
from k3compile.engine.provenance import node_provenance
from k3compile.model_def.config import get_preset
from k3compile.model_def.loader import build_model, init_random
from k3compile.passes.launches import node_launches
from k3compile.passes.manager import PassManager
from k3compile.passes.pipeline import PipelineConfig

# k3 ops whose CUDA implementation launches more than one kernel (H200 trace, k3-mini-6b decode)
MULTI_KERNEL_OPS = {
    "k3.fused_moe_decode.default": 3,  # expert up, expert down, latent out (a full-width MoE: 2, `_kernels`)
    "k3.mla_decode_fused.default": 2,  # split, merge
    "k3.mla_decode_fused_out.default": 2,  # split, merge (+ W_UV): with it the count matches the trace's 323 (s9)
    "k3.fused_moe_decode_norm.default": 3,  # p07_moe_out_norm: expert up, expert down, latent out + the norm tail
}


def tiny_dims(cfg):
    """`cfg`'s layer structure on k3-tiny's widths."""
    tiny = get_preset("k3-tiny")
    keep = ("name", "num_hidden_layers", "layer_types", "attn_res_block_size", "first_k_dense_replace",
            "moe_layer_freq", "hidden_act", "num_shared_experts", "latent_norm", "kda_full_rank_gate",
            "mla_output_gate", "gate_lower_bound", "q_lora_rank", "routed_scaling_factor")
    over = {k: getattr(cfg, k) for k in keep if hasattr(cfg, k)}
    if cfg.q_lora_rank is not None:
        over["q_lora_rank"] = tiny.q_lora_rank
    if not cfg.latent_size:
        over["latent_size"] = cfg.latent_size
    return tiny.replace(**over)


def _kernels(node, op: str, launches: int) -> int:
    if op == "k3.fused_moe_decode.default":  # kernel C (latent norm + up-projection) only in a latent MoE
        latent_up_w = node.args[14] if len(node.args) > 14 else node.kwargs.get("latent_up_w")
        return 3 if latent_up_w is not None else 2
    return MULTI_KERNEL_OPS.get(op, launches)


def kernels_by_layer(gm) -> dict[str, collections.Counter]:
    """{layer label: Counter(op label -> kernels)} over the graph's call nodes."""
    prov = node_provenance(gm)
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for node in gm.graph.nodes:
        n = node_launches(node)
        if not n:
            continue
        p = prov[node.name]
        out[p["layer"]][p["op"]] += _kernels(node, p["op"], n)
    return dict(out)


def _layer_order(label: str):
    return (0, 0) if label == "embed" else (2, 0) if label == "head" else (
        (1, int(label[1:])) if label.startswith("L") else (3, 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset")
    ap.add_argument("--tiny-dims", action="store_true", help="the preset's layer structure on k3-tiny's widths")
    ap.add_argument("--passes", default="all", help="all (default pipeline), none, or p01,p02,...")
    ap.add_argument("--json", help="write {layer: {op: kernels}} here")
    ap.add_argument("--pass-opt", action="append", default=[], metavar="PASS.OPT=VALUE",
                    help="a pass option on top of the pipeline (repeatable), e.g. p08_small_m_gemm.choice=gemv "
                         "(P8 measures only on CUDA: on a CPU, gemv is what the H200 chose for the decode GEMMs)")
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    if args.tiny_dims:
        cfg = tiny_dims(cfg)
    model = build_model(cfg, torch.bfloat16, "cpu")
    init_random(model, 0)
    gm = capture_step(model, "decode")
    if args.passes != "none":
        config = PipelineConfig.default()
        if args.passes != "all":
            config = PipelineConfig(order=args.passes.split(","), configs={
                n: config.configs[n] for n in args.passes.split(",")})
        for opt in args.pass_opt:
            name, value = opt.split("=", 1)
            pass_name, key = name.split(".", 1)
            config.set_option(pass_name, key, value)
        PassManager(config).run(gm)
    table = kernels_by_layer(gm)
    layers = sorted(table, key=_layer_order)
    per_layer = [sum(table[k].values()) for k in layers if k.startswith("L")]
    print(f"{args.preset}{' (tiny dims)' if args.tiny_dims else ''}, passes {args.passes}: "
          f"{sum(sum(c.values()) for c in table.values())} kernels per decode step, "
          f"{sum(per_layer) / max(1, len(per_layer)):.1f} per layer (min {min(per_layer)}, max {max(per_layer)})")
    for k in layers:
        kinds = ", ".join(f"{op.replace('.default', '')} {n}" for op, n in sorted(table[k].items(), key=lambda t: -t[1]))
        kind = ("" if not k.startswith("L") else
                f" [{cfg.layer_types[int(k[1:])]}/{'moe' if cfg.is_moe_layer(int(k[1:])) else 'dense'}]")
        print(f"{k:>6}{kind:<12} {sum(table[k].values()):3d}: {kinds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: dict(v) for k, v in table.items()}, f, indent=1)


if __name__ == "__main__":
    main()
