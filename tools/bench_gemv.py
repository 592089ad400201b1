"""Decode GEMV shapes of the 48B and k3-mini-6b steps: cuBLAS vs each Triton GEMV candidate P8 measures.

    python3 tools/bench_gemv.py [--json OUT]      (CUDA; ~1 min)

Prints, per (N, K) and M, the microseconds of cuBLAS and of each candidate (block_n x block_k x split_k x
design; design 0 = dot, 1 = rows), with the bandwidth of the best, as % of a same-run copy's. P8 makes
the same measurement at build (passes/p08_small_m_gemm.py `_measure`), so this is what it will choose from.

    python3 tools/bench_gemv.py --p8 [--mini] [--timing pdl_chain] [--buckets 1] [--rows-programs 132+528]
                                [--rows-warps 2+4+8] [--json OUT]   (CUDA; ~1 min)

P8's own measurement and decision at the 48B shapes (`P8_SHAPES`; --mini: k3-mini-6b's), with its option `timing` at "pdl_chain"
(candidates launched with PDL in the timed chain, as the engine runs them) and at "alone" (without): per shape
and timing, the seconds the measuring took (Triton compiles included), the choice (max_m and configuration,
as P8 would record it), and per bucket cuBLAS, the best candidate and the chosen one.

    python3 tools/bench_gemv.py --pdl-chain [--json OUT]   (CUDA; ~1-2 min)

The PDL question instead (issue 9, kda8): at the KDA o_proj and in_proj shapes, a graph of `CHAIN` GEMVs back
to back (distinct weight copies, L2 overflowed), µs per GEMV for cuBLAS and for Triton configurations with
PDL off and on (with PDL the next GEMV's launch and first weight tile overlap this one's tail): the rows
design's tile (block_n x block_k) and warps swept at M = 1, the dot design at M = 1, 4, 8."""
import argparse
import json

import torch

from k3compile.passes.kernels import gemv as gemv_kernels
from k3compile.passes.kernels.graph_timing import copies_to_overflow_l2, replay_us
from k3compile.passes.p08_small_m_gemm import TIMINGS, SmallMGemmConfig, _decide, _measure, config_label

SHAPES = {  # (N, K): what the GEMM is
    (2304, 4096): "48B KDA o_proj",
    (12672, 2304): "48B KDA merged in-proj (approx.)",
    (2048, 2304): "48B shared expert gate/up",
    (2304, 1024): "48B shared expert down",
    (2304, 9216): "48B dense MLP down",
    (163840, 2304): "48B lm_head",
}


def copy_bandwidth() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        b.copy_(a)
    e.record()
    e.synchronize()
    return 2 * a.numel() * 20 / (s.elapsed_time(e) * 1e-3)


PDL_SHAPES = {(2304, 4096): "48B KDA o_proj", (12576, 2304): "48B KDA merged in-proj"}
CHAIN = 24  # GEMVs per timed graph


def pdl_configs(n: int, k: int, m: int):
    """(block_n, block_k, split_k, design, num_warps): the rows design's tiles and warps at M = 1 (split-K as P8's
    rows_configs picks it), the dot design's default and a wide-K tile at every M."""
    out = []
    if m <= gemv_kernels.ROWS_MAX_M and m == 1:
        for block_n in (4, 16):
            for tile in (4096, 8192):
                block_k = max(16, min(tile // block_n, 1 << (k - 1).bit_length()))
                tiles, split = -(-n // block_n), 1
                while tiles * split < gemv_kernels.ROWS_TARGET_PROGRAMS and k // (split * 2) >= block_k and split < 32:
                    split *= 2
                out += [(block_n, block_k, split, gemv_kernels.DESIGNS["rows"], w) for w in (2, 4, 8)]
    bn, bk, split = gemv_kernels.default_config(n, k)
    out += [(bn, bk, split, gemv_kernels.DESIGNS["dot"], 4), (32, 256, split, gemv_kernels.DESIGNS["dot"], 4)]
    return out


def pdl_chain(buckets) -> dict:
    out = {}
    for (n, k), what in PDL_SHAPES.items():
        assert CHAIN >= copies_to_overflow_l2(2 * n * k), "the chain's weights must overflow L2"
        weights = [(0.02 * torch.randn(n, k, device="cuda")).bfloat16() for _ in range(CHAIN)]
        res = out[f"{n}x{k}"] = {"what": what, "us": {}}
        for m in buckets:
            x = torch.randn(m, k, device="cuda").bfloat16()
            row = res["us"][m] = {"cublas": replay_us([lambda w=w: torch.mm(x, w.t()) for w in weights])}
            for bn, bk, split, design, warps in pdl_configs(n, k, m):
                for pdl in (False, True):
                    name = f"{bn}x{bk}x{split}x{design} w{warps} pdl {'on' if pdl else 'off'}"
                    try:
                        row[name] = replay_us([lambda w=w: gemv_kernels.gemv_triton(
                            x, w, None, bn, bk, split, num_warps=warps, design=design, use_pdl=pdl) for w in weights])
                    except Exception as e:  # a configuration the device cannot run: reported, not fatal
                        row[name] = f"{type(e).__name__}: {str(e)[:120]}"
            best = min(((v, c) for c, v in row.items() if c != "cublas" and isinstance(v, float)), default=None)
            byts = 2 * n * k
            print(f"{what:24s} N={n:6d} K={k:5d} M={m:2d} chain of {CHAIN}: cublas {row['cublas']:6.2f} us"
                  + (f"  best triton {best[0]:6.2f} us ({best[1]}), {byts / best[0] / 1e3:.0f} GB/s" if best else ""))
            for c, v in row.items():
                if c != "cublas":
                    print(f"    {c:32s} {v:6.2f} us" if isinstance(v, float) else f"    {c:32s} {v}")
        del weights
    return out


P8_SHAPES = {  # (N, K): the 48B decode GEMMs issue 9's gemv9 brief names
    (12576, 2304): "48B KDA merged in-proj",
    (2304, 4096): "48B KDA / MLA o_proj",
    (6720, 2304): "48B MLA input GEMM (q 6144 + kv_a 576)",
    (163840, 2304): "48B lm_head",
}
P8_SHAPES_MINI = {  # (N, K): every decode GEMM P8 sees in k3-mini-6b (tools/decode_budget.py's kinds)
    (8336, 2048): "k3-mini KDA merged in-proj (q k v g f_a b) x21",
    (2048, 2048): "k3-mini KDA / MLA o_proj x29",
    (3072, 2048): "k3-mini MoE front (latent down, shared gate/up) x28",
    (3392, 2048): "k3-mini MLA input (q_a kv_a g) x8",
    (3072, 768): "k3-mini MLA q_b (norm_gemv's GEMV) x8",
    (16384, 2048): "k3-mini dense gate/up x1",
    (2048, 8192): "k3-mini dense down x1",
    (163840, 2048): "k3-mini lm_head x1",
}


def p8_timings(buckets, shapes=None, timings=TIMINGS, rows_warps=None, rows_programs=None) -> dict:
    """P8's `_measure` + `_decide` per shape, timed each way in `timings`, with P8's default options unless
    rows_warps / rows_programs (P8's options, as tuples) are given."""
    import time
    opts = SmallMGemmConfig()
    rows_warps = rows_warps or tuple(int(w) for w in opts.rows_warps.split(","))
    rows_programs = rows_programs or tuple(int(p) for p in opts.rows_programs.split(","))
    out = {}
    total = dict.fromkeys(timings, 0.0)
    for (n, k), what in (shapes or P8_SHAPES).items():
        w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
        res = out[f"{n}x{k}"] = {"what": what}
        for timing in timings:
            t0 = time.perf_counter()
            t = _measure(w, buckets, opts.bench_ms, use_pdl=timing == "pdl_chain", rows_warps=rows_warps,
                         rows_programs=rows_programs)
            secs = time.perf_counter() - t0
            total[timing] += secs
            max_m, cfg = _decide(t, buckets, opts.min_gain, opts.first_bucket_tol)  # as P8 decides
            label = config_label(cfg) if cfg else "cublas"
            res[timing] = {"seconds": secs, "max_m": max_m, "config": label,
                           "us": {m: {"cublas": r["cublas_us"], **{config_label(c): v for c, v in r["gemv_us"].items()}}
                                  for m, r in t.items()}, "errors": {m: r["errors"] for m, r in t.items() if "errors" in r}}
            print(f"{what:40s} N={n:6d} K={k:5d} timing {timing:9s} ({secs:5.1f} s): choice max_m={max_m} {label}")
            for m, r in t.items():
                best_cfg, best = min(r["gemv_us"].items(), key=lambda kv: kv[1], default=(None, float("nan")))
                chosen = r["gemv_us"].get(cfg) if cfg and m <= max_m else None
                gbs = 2 * n * k / best / 1e3 if best == best else float("nan")  # weight bytes / us
                print(f"    M={m:2d}  cublas {r['cublas_us']:7.2f} us  best {best:7.2f} us "
                      f"({config_label(best_cfg) if best_cfg else '-'}, {gbs:.0f} GB/s)  chosen "
                      + (f"{chosen:7.2f} us" if chosen is not None else "cublas")
                      + "".join(f"\n      ERROR {c}: {e}" for c, e in r.get("errors", {}).items()))
                if len(rows_programs) > 1 or len(rows_warps) > 3:  # every candidate, for the sweep's question
                    print("      " + " ".join(f"{config_label(c)}={v:.2f}" for c, v in sorted(r["gemv_us"].items())))
        del w
    print("measuring seconds, all shapes: " + ", ".join(f"{tm} {v:.1f} s" for tm, v in total.items()))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--buckets", default=None, help="M values (default 1,2,4,8; with --p8, P8's buckets)")
    p.add_argument("--pdl-chain", action="store_true", help="the PDL chain sweep instead (see the module doc)")
    p.add_argument("--p8", action="store_true", help="P8's measurement and choice, pdl_chain vs alone (module doc)")
    p.add_argument("--mini", action="store_true", help="with --p8: k3-mini-6b's GEMM shapes instead of the 48B's")
    p.add_argument("--timing", default=",".join(TIMINGS), help="with --p8: P8 timings to run (comma list)")
    p.add_argument("--rows-warps", help="with --p8: P8's rows_warps ('+' or ',' between values)")
    p.add_argument("--rows-programs", help="with --p8: P8's rows_programs ('+' or ',' between values)")
    a = p.parse_args()
    if a.p8:
        buckets = [int(b) for b in (a.buckets or SmallMGemmConfig().buckets).split(",")]

        def ints(text):
            return tuple(int(v) for v in text.replace("+", ",").split(",")) if text else None
        out = p8_timings(buckets, P8_SHAPES_MINI if a.mini else P8_SHAPES, tuple(a.timing.split(",")),
                         ints(a.rows_warps), ints(a.rows_programs))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"buckets": buckets, "shapes": out}, f, indent=1)
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if a.pdl_chain:
        out = pdl_chain([1, 4, 8])
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"copy_gbs": bw / 1e9, "chain": CHAIN, "shapes": out}, f, indent=1)
        return
    buckets = [int(b) for b in (a.buckets or "1,2,4,8").split(",")]
    out = {}
    for (n, k), what in SHAPES.items():
        w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
        t = _measure(w, buckets, 20.0)
        out[f"{n}x{k}"] = {"what": what, "us": {m: {"cublas": r["cublas_us"],
                                                    **{config_label(c): v for c, v in r["gemv_us"].items()}}
                                               for m, r in t.items()}}
        for m, r in t.items():
            best_cfg, best = min(r["gemv_us"].items(), key=lambda kv: kv[1])
            byts = 2 * n * k
            print(f"{what:34s} N={n:6d} K={k:5d} M={m:2d}  cublas {r['cublas_us']:7.2f} us "
                  f"({byts / r['cublas_us'] / 1e3 / (bw / 1e9) * 100:5.1f}%)  best triton {best:7.2f} us "
                  f"({byts / best / 1e3 / (bw / 1e9) * 100:5.1f}%) {config_label(best_cfg)}  | "
                  + " ".join(f"{config_label(c)}={v:.1f}" for c, v in sorted(r["gemv_us"].items())))
        del w
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_gbs": bw / 1e9, "shapes": out}, f, indent=1)


if __name__ == "__main__":
    main()
