"""Summary of tools/gpu_serve13.sh (issue 9 Deliver 2, "the fast path is the served path"): one engine built by
`k3compile build`, served twice (split pools; --enable-unified-memory; prefix cache on in both) and driven by the
openai client, and timed by `bench decode` in the same call. Prints what the engine is, then the ratios:

  served ITL p50 at concurrency 1 / bench decode's engine step at batch 1   (the served path vs what the ladder times)
  server's own decode forward at batch 1 (serve --step-timing) / that step  (device time inside the server)
  engine-served / engine (bench decode, one run)                            (serve's executor: buckets, context)
  output tokens/s at concurrency 8; cached prompt tokens when the first run's prompts come again; unified / split

    python3 tools/serve13_summary.py OUT_DIR
Reads OUT_DIR/engine.json (a copy of the engine's manifest), serve_split.json, serve_unified.json and
decode/decode_*.json; a part that did not run is reported as missing.
"""
import glob
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def engine_lines(m):
    if m is None:
        return ["engine: no manifest (the build did not finish)"]
    dec = m["passes"]["decode"]
    names = [p["name"] for p in dec["passes"]]
    p8 = next((p.get("details") or {} for p in dec["passes"] if p["name"] == "p08_small_m_gemm"), {})
    nodes = p8.get("nodes", [])
    gemv = sum(1 for n in nodes if n.get("choice") == "gemv")
    return [f"engine: {m['model']['name']} {m['dtype']}, built in {m['build'].get('seconds', 0):.0f} s on "
            f"{m['build'].get('device')}; decode graph: {len(names)} passes ({', '.join(names)}), launches "
            f"{dec.get('launches_before')} -> {dec.get('launches_after')}; CUDA-graph buckets {m['decode_buckets']}; "
            f"P8 measured on {p8.get('measured_on')}: {gemv} GEMMs -> Triton GEMV, {len(nodes) - gemv} stay cuBLAS"]


def bench_steps(doc):
    """{(arm, batch): median ms} of a bench decode document."""
    if doc is None:
        return {}
    return {(r["arm"], r["batch"]): r["median_ms"] for r in doc["results"] if r.get("status") == "ok"
            and r.get("median_ms")}


def fmt(v, unit="ms", digits=3):
    return "n/a" if v is None else f"{v:.{digits}f} {unit}".strip()


def ratio(a, b):
    return None if a is None or not b else a / b


def serve_lines(label, doc, steps):
    if doc is None:
        return [f"{label}: did not run (see logs/)"], {}
    runs = doc["runs"]
    by = {}
    for r in runs:
        by[("repeat" if r.get("repeat") else "c"), r["max_concurrency"]] = r
    c1, c8, rep = by.get(("c", 1)), by.get(("c", 8)), by.get(("repeat", 1))
    step1, step8 = steps.get(("engine", 1)), steps.get(("engine", 8))
    out = [f"{label} (client {doc.get('client')}, {doc.get('input_len')} prompt / {doc.get('output_len')} output "
           f"tokens, greedy):"]
    got = {}
    if c1:
        fwd = c1.get("server_forward_ms") if c1.get("server_forward_batch") == 1 else None
        got.update(itl1=c1["median_itl_ms"], fwd1=fwd)
        out.append(f"  c=1: ITL p50 {fmt(c1['median_itl_ms'])}, TPOT p50 {fmt(c1['median_tpot_ms'])}, TTFT p50 "
                   f"{fmt(c1['median_ttft_ms'], digits=1)}; server decode forward at batch 1 {fmt(fwd)}; "
                   f"ITL p50 / bench step b1 = {fmt(ratio(c1['median_itl_ms'], step1), 'x')}, server forward / "
                   f"bench step b1 = {fmt(ratio(fwd, step1), 'x')}; {c1['completed']} ok, {c1['failed']} failed, "
                   f"{c1['chunks_per_output_token']:.2f} chunks per token")
    if c8:
        fwd8 = (c8.get("server_decode_forward") or {}).get("8", {}).get("mean_ms")
        got.update(tps8=c8["output_throughput"])
        out.append(f"  c=8: {c8['output_throughput']:.0f} output tok/s, ITL p50 {fmt(c8['median_itl_ms'])}; server "
                   f"decode forward at batch 8 {fmt(fwd8)} / bench step b8 = {fmt(ratio(fwd8, step8), 'x')}; "
                   f"{c8['completed']} ok, {c8['failed']} failed")
    if rep and c1:
        got.update(cached=rep["total_cached_tokens"])
        out.append(f"  repeat of the c=1 prompts: {rep['total_cached_tokens']} of {rep['total_input_tokens']} prompt "
                   f"tokens cached (first time: {c1['total_cached_tokens']}); TTFT p50 {fmt(rep['median_ttft_ms'], digits=1)}"
                   f" vs {fmt(c1['median_ttft_ms'], digits=1)} the first time")
    return out, got


def main(out_dir):
    lines = engine_lines(load(os.path.join(out_dir, "engine.json")))
    dec = next((load(p) for p in sorted(glob.glob(os.path.join(out_dir, "decode", "decode_*.json")))), None)
    steps = bench_steps(dec)
    if dec is None:
        lines.append("bench decode: did not run")
    else:
        ctx = dec["config"]["context"]
        served = dec["config"].get("compile", {}).get("engine-served", {})
        for b in dec["config"]["batches"]:
            e, s = steps.get(("engine", b)), steps.get(("engine-served", b))
            lines.append(f"bench decode b={b} (context {ctx}): engine {fmt(e)} (the ladder's executor: one bucket, "
                         f"capacity {ctx}), engine-served {fmt(s)} (serve's: buckets {served.get('buckets')}, "
                         f"capacity {served.get('max_context')}): served/ladder executor = {fmt(ratio(s, e), 'x')}; "
                         f"eager {fmt(steps.get(('eager', b)), digits=1)}")
    got = {}
    for label in ("split", "unified"):
        more, got[label] = serve_lines(f"serve ({label})", load(os.path.join(out_dir, f"serve_{label}.json")), steps)
        lines += more
    a, b = got.get("split", {}), got.get("unified", {})
    if a and b:
        lines.append(f"unified / split: ITL p50 at c=1 {fmt(ratio(b.get('itl1'), a.get('itl1')), 'x')}, "
                     f"tok/s at c=8 {fmt(ratio(b.get('tps8'), a.get('tps8')), 'x')}")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
