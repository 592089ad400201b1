"""n > 1 sampling: one request with n samples (one prefill, the state forked n ways) against n
separate requests for the same prompt sent at once. Prints one JSON line per arm: prefill tokens
computed, peak state-slot and KV-page use (and bytes), forked requests, wall time; and whether the
greedy outputs of both arms agree.

    python tools/bench_fork.py --model k3-tiny --n 8 --prompt-len 200 [--device cuda] [--unified]
"""
from __future__ import annotations

import argparse
import json
import random
import time


def run_arm(args, fork: bool) -> tuple[dict, list[list[int]]]:
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, dtype=args.dtype,
                                  enable_unified_memory=args.unified, memory_bytes=args.memory_bytes))
    rng = random.Random(0)
    prompt = [rng.randrange(0, 256) for _ in range(args.prompt_len)]
    params = SamplingParams(max_new_tokens=args.max_new, ignore_eos=True)
    rids = [f"r{i}" for i in range(args.n)]
    if fork:
        engine.add_request(rids[0], prompt, params, fork_rids=tuple(rids[1:]))
    else:
        for rid in rids:
            engine.add_request(rid, prompt, params)
    mem = engine.memory
    base_slots, base_pages = mem.num_used_slots(), mem.num_used_pages()
    peak_slots = peak_pages = 0
    outs = {rid: [] for rid in rids}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.rid].extend(o.new_token_ids)
        peak_slots = max(peak_slots, mem.num_used_slots() - base_slots)
        peak_pages = max(peak_pages, mem.num_used_pages() - base_pages)
    wall = time.perf_counter() - t0
    m = engine.metrics()
    spec = mem.spec
    sb, pb = spec.slot_bytes, spec.page_bytes(engine.args.page_size)
    engine.close()
    return {"arm": f"n={args.n} forked" if fork else f"{args.n} separate requests", "model": args.model,
            "device": args.device, "unified": args.unified, "prompt_tokens": args.prompt_len,
            "max_new_tokens": args.max_new, "prefill_tokens": m["prefill_tokens"],
            "forked_requests": m["forked_requests"], "peak_state_slots": peak_slots,
            "peak_state_bytes": peak_slots * sb, "peak_kv_pages": peak_pages, "peak_kv_bytes": peak_pages * pb,
            "slot_bytes": sb, "page_bytes": pb, "wall_s": round(wall, 3)}, [outs[r] for r in rids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--memory-bytes", type=int, default=None)
    ap.add_argument("--unified", action="store_true")
    args = ap.parse_args()
    forked, out_f = run_arm(args, fork=True)
    separate, out_s = run_arm(args, fork=False)
    print(json.dumps(forked))
    print(json.dumps(separate))
    print(json.dumps({"greedy_outputs_equal": out_f == out_s,
                      "prefill_ratio": separate["prefill_tokens"] / max(1, forked["prefill_tokens"]),
                      "state_bytes_ratio": separate["peak_state_bytes"] / max(1, forked["peak_state_bytes"]),
                      "kv_bytes_ratio": separate["peak_kv_bytes"] / max(1, forked["peak_kv_bytes"])}))


if __name__ == "__main__":
    main()
