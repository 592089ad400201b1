"""P7's norm + P8's GEMV as two launches vs one k3.norm_gemv launch (pass p08_small_m_norm_gemv), at the 48B
decode shapes whose input is a norm: the KDA merged in_proj (N 12576) and the dense MLP's gate/up (N 18432),
K 2304, M = 1 and 4 (--ms).

    python3 tools/bench_norm_gemv.py [--json OUT]      (CUDA; ~1 min)

Per shape, M and GEMV configuration (P8's candidates for that M, rows design warps --warps, default 4), µs per
(norm, GEMV) pair and per fused call, both launched with PDL back to back in one CUDA graph over enough weight
copies that every weight read comes from HBM (kernels/graph_timing.py), and the saving. Printed per (shape, M): the
configuration with the best pair (the fused call at that same configuration is what the pass emits: it keeps P8's
choice) and the one with the best fused call; the JSON has every configuration."""
import argparse
import json

import torch

from k3compile.passes.kernels import gemv as gv
from k3compile.passes.kernels import norm_gemv as ng
from k3compile.passes.kernels.graph_timing import copies_to_overflow_l2, replay_us
from k3compile.passes.p08_small_m_gemm import _candidates, config_label

SHAPES = {"kda in_proj": (12576, 2304), "mlp gate/up": (18432, 2304)}
NORM = torch.ops.k3.attn_res_norm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ms", default="1,4", help="rows (decode batch) per shape, comma list")
    ap.add_argument("--warps", default="4", help="rows design warps tried (comma list; each is a Triton compile)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    print(f"{'shape':12} {'M':>2} {'config':18} {'pair us':>8} {'fused us':>8} {'saved us':>8}")
    for label, (n, k) in SHAPES.items():
        w = (0.02 * torch.randn(n, k, device=dev, generator=gen)).bfloat16()
        weights = [w] + [w.clone() for _ in range(copies_to_overflow_l2(w.numel() * 2, dev) - 1)]
        nw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).bfloat16()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            d = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            rows = []
            for cfg in _candidates(n, k, sm, tuple(int(v) for v in args.warps.split(","))):
                bn, bk, split, design, warps = cfg
                if design == gv.DESIGNS["rows"] and m > gv.ROWS_MAX_M:
                    continue

                def pair(wi):
                    h, _ = NORM([], x, d, None, nw, 0.0, 1e-6, True)
                    return gv.gemv_triton(h, wi, None, bn, bk, split, num_warps=warps, design=design, use_pdl=True)

                def fused(wi):
                    return ng.norm_gemv_triton(x, d, nw, 1e-6, wi, None, bn, bk, split, num_warps=warps,
                                               design=design, use_pdl=True)
                try:
                    t_pair = replay_us([lambda wi=wi: pair(wi) for wi in weights])
                    t_fused = replay_us([lambda wi=wi: fused(wi) for wi in weights])
                except Exception as e:  # a configuration this device cannot run: reported, not fatal
                    print(f"{label:12} {m:>2} {config_label(cfg):18} error {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append({"shape": label, "N": n, "K": k, "M": m, "config": config_label(cfg),
                             "pair_us": round(t_pair, 2), "fused_us": round(t_fused, 2)})
            if not rows:
                continue
            best_pair = min(rows, key=lambda r: r["pair_us"])
            best_fused = min(rows, key=lambda r: r["fused_us"])
            for tag, r in (("best pair", best_pair), ("best fused", best_fused)):
                print(f"{label:12} {m:>2} {r['config']:18} {r['pair_us']:8.2f} {r['fused_us']:8.2f} "
                      f"{r['pair_us'] - r['fused_us']:8.2f}  ({tag})")
            out += rows
            if args.json:  # after every (shape, M): a timeout keeps what was measured
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
