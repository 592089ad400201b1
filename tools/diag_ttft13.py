"""Where a served request's time to first token goes (session 13, ttft13): the engine `serve` runs, in-process,
without the HTTP layer, timed per request and per forward.

Session 13 served k3-mini-6b (H200, traces/h200_s13/call3): 448-token prompts had TTFT p50 643 ms at concurrency 1
and 225 ms when 432 of the 448 tokens were cached -- about 200 ms per prefill forward whatever its size (a new
448-token prompt runs 3 forwards: 256 + 176 + 16 tokens; its repeat 1 forward of 16). This measures, with the same
EngineArgs as `serve ENGINE --memory-bytes M --step-timing`:
  A. TTFT of 4 new 448-token prompts one at a time, and of the same prompts again (prefix-cache hits); per prefill
     forward: tokens, host ms (the call that launches it) and device ms (CUDA events around it); the engine step's
     other host work (schedule, sampling, applying results) as the rest of the TTFT.
  B. the same with chunk_size 2048 (serve --chunk-size 2048): 2 forwards per new prompt instead of 3; and (chunk 256)
     with the short convs' per-step layout cache off (model_def/ops/library.py: each conv makes its own, as before).
  C. one prefill forward of 256 tokens and one of 16 under torch.profiler (CPU + CUDA): host ops, kernels, top ops
     by self CPU time, k3:: custom ops, and host syncs (torch.cuda.set_sync_debug_mode) per forward.
  D. pass p18_short_conv_merge (off by default): the prefill graph captured again from the same preset and seed as
     the engine (`build` makes its weights the same way) and run through the default pipeline, with P18 off and on,
     each swapped into the running engine; A and C again for both, and the first tokens of a fixed prompt (the same
     with P18 on and off: it is bit-identical). Skipped for an engine of no preset (a checkpoint).
    python tools/diag_ttft13.py ENGINE_DIR OUT_DIR [MEMORY_BYTES]
Writes OUT_DIR/ttft.json (after each part: A, B, C's counts, D) and OUT_DIR/profile_*.txt (by the forward's token
count and arm); prints a summary.
On a CPU (no GPU) it checks itself on a small engine (no device times, no syncs).
"""
import json
import random
import statistics
import sys
import time
import warnings
from dataclasses import replace

import torch

from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams

engine_dir, out_dir = sys.argv[1], sys.argv[2]
memory = int(float(sys.argv[3])) if len(sys.argv) > 3 else 40_000_000_000
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PROMPT_LEN, OUT_TOKENS = 448, 4
t_start = time.perf_counter()


def say(msg):
    print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


# the decode buckets matter not for a first token: one graph (bucket 1) keeps the start-up short
eng = LLMEngine(EngineArgs(model=None, engine_dir=engine_dir, device=DEVICE, memory_bytes=memory, step_timing=True,
                           cuda_graph_buckets=(1,)))
say(f"engine loaded ({eng.memory_summary()})")
vocab = eng.config.vocab_size
forwards = []   # (mode, tokens, host s, start event, end event) of every forward while recording
run_forward = eng.runner.executor.run


def timed_run(batch):
    ev = None
    if CUDA:
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
    t0 = time.perf_counter()
    out = run_forward(batch)
    host = time.perf_counter() - t0
    if ev is not None:
        ev[1].record()
    forwards.append((batch.mode, int(batch.input_ids.shape[0]), host, ev))
    return out


eng.runner.executor.run = timed_run


def prompts(seed, n=4):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def one(rid, prompt):
    """TTFT of one request alone (engine-side: add_request to the step that returns its first token), and the
    forwards it ran until then."""
    forwards.clear()
    step_host = 0.0
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(max_new_tokens=OUT_TOKENS, ignore_eos=True))
    ttft = None
    while ttft is None:
        s0 = time.perf_counter()
        outs = eng.step()
        step_host += time.perf_counter() - s0
        if any(o.rid == rid and o.new_token_ids for o in outs):
            ttft = time.perf_counter() - t0
    upto = list(forwards)
    while eng.has_unfinished():
        eng.step()
    sync()
    pre = [(n, h, ev[0].elapsed_time(ev[1]) / 1e3 if ev is not None else h) for m, n, h, ev in upto
           if m == "prefill"]
    fwd_host = sum(h for _, h, _ in pre)
    return {"ttft_ms": ttft * 1e3, "prefill_forwards": len(pre), "tokens": [n for n, _, _ in pre],
            "host_ms": [round(h * 1e3, 2) for _, h, _ in pre], "device_ms": [round(d * 1e3, 2) for _, _, d in pre],
            "other_ms": (ttft - fwd_host) * 1e3, "decode_forwards_before": sum(m == "decode" for m, *_ in upto)}


def arm(label, seed):
    res = {"new": [one(f"{label}-n{i}", p) for i, p in enumerate(prompts(seed))]}
    res["repeat"] = [one(f"{label}-r{i}", p) for i, p in enumerate(prompts(seed))]
    for kind in ("new", "repeat"):
        rs = res[kind]
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        host = [h for r in rs for h in r["host_ms"]]
        dev = [d for r in rs for d in r["device_ms"]]
        say(f"{label} {kind}: TTFT p50 {med('ttft_ms'):.1f} ms, {med('prefill_forwards'):.0f} prefill forwards "
            f"({rs[-1]['tokens']} tokens), per forward host {statistics.median(host):.1f} ms / device "
            f"{statistics.median(dev):.1f} ms (median); rest of the TTFT {med('other_ms'):.1f} ms")
    return res


doc = {"engine": engine_dir, "device": DEVICE, "prompt_len": PROMPT_LEN, "memory_bytes": memory}
# first contact compiles and autotunes the prefill kernels for these shapes (serve's warm-up does one chunk)
t0 = time.perf_counter()
for p in prompts(1, 2) * 2:   # one at a time (the shapes of A), new then repeated
    eng.generate([p], SamplingParams(max_new_tokens=2, ignore_eos=True))
say(f"first requests (compiles, autotuning): {time.perf_counter() - t0:.1f} s")
doc["chunk256"] = arm("chunk 256", 10)
cfg = eng.scheduler.cfg
eng.scheduler.cfg = replace(cfg, chunk_size=2048)
eng.generate(prompts(2, 1), SamplingParams(max_new_tokens=2, ignore_eos=True))   # the 432-token chunk's shapes
doc["chunk2048"] = arm("chunk 2048", 20)
eng.scheduler.cfg = cfg

# the short convs' per-step layout cache (model_def/ops/library.py, on since ttft13) off: every conv makes its own
from k3compile.model_def.ops import kda_math, library   # noqa: E402

cached_layout = library._conv_step_layout
library._conv_step_layout = lambda cu, seq, n, w: (library._fresh(cu, seq).view(-1, 1, 1),
                                                   kda_math.short_conv_layout(cu, n, w) if w > 1 else None)
doc["conv_layout_uncached"] = arm("conv layout uncached", 40)
library._conv_step_layout = cached_layout


def profile_forward(prompt_len: int, arm_name: str = "engine"):
    """The first prefill forward of a new prompt of `prompt_len` tokens (257: a 256-token chunk, then the 1-token
    tail; 16: one forward), profiled; then its syncs counted."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(f"{arm_name}-{prompt_len}")   # a new prompt per arm: no cache hit
    captured = {}

    def capture(batch):
        if batch.mode == "prefill" and "batch" not in captured:
            captured["batch"] = batch
        return timed_run(batch)

    eng.runner.executor.run = capture
    eng.generate([[rng.randrange(vocab) for _ in range(prompt_len)]], SamplingParams(max_new_tokens=1, ignore_eos=True))
    eng.runner.executor.run = timed_run
    batch = captured["batch"]   # re-running it rewrites the same KV rows and its slot's state: harmless here
    tokens = int(batch.input_ids.shape[0])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    sync()
    with profile(activities=acts) as prof:
        run_forward(batch)
        sync()
    events = prof.events()
    top = [e for e in events if e.cpu_parent is None and e.device_type.name == "CPU"]
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    custom = {}
    for e in top:
        if e.name.startswith("k3::"):
            c = custom.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += e.cpu_time_total / 1e3
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    with open(f"{out_dir}/profile_{arm_name}_{tokens}.txt", "w") as f:
        f.write(table)
    syncs = None
    if CUDA:
        sync()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_forward(batch)
        torch.cuda.set_sync_debug_mode(0)
        sync()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    t0 = time.perf_counter()
    run_forward(batch)
    host = time.perf_counter() - t0
    sync()
    wall = time.perf_counter() - t0
    aten_ops = sum(1 for e in events if e.device_type.name == "CPU" and e.name.startswith("aten::"))
    res = {"tokens": tokens, "top_level_host_ops": len(top), "aten_ops": aten_ops, "cuda_kernels": len(kernels),
           "host_syncs": syncs,
           "host_ms": host * 1e3, "wall_ms": wall * 1e3,
           "custom_ops": {k: {"calls": n, "cpu_ms": round(ms, 2)} for k, (n, ms) in sorted(custom.items())}}
    say(f"{arm_name}: prefill forward of {tokens} tokens: {len(top)} top-level host ops ({aten_ops} aten ops in all), "
        f"{len(kernels)} kernels, {syncs} syncs, host "
        f"{host * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms; k3:: ops " +
        ", ".join(f"{k[4:]} {v['calls']}x {v['cpu_ms']:.0f} ms" for k, v in res["custom_ops"].items()))
    return res


def save():
    with open(f"{out_dir}/ttft.json", "w") as f:
        json.dump(doc, f, indent=1)


save()
doc["profile"] = [profile_forward(257), profile_forward(16)]
doc["metrics"] = {k: eng.metrics().get(k) for k in ("prefill_forward", "first_token")}
save()


def recaptured_prefill(p18: bool):
    """The engine's prefill graph made again (capture + the default pipeline) from `model`, P18 on or off."""
    from k3compile.capture import capture_step
    from k3compile.passes.manager import PassManager
    from k3compile.passes.pipeline import PipelineConfig

    gm = capture_step(model, "prefill")
    pipeline = PipelineConfig.default()
    pipeline.set_option("p18_short_conv_merge", "enabled", p18)
    report = PassManager(pipeline).run(gm, graph_name="prefill")
    matches = {r.name: r.matches for r in report.passes}.get("p18_short_conv_merge")
    return gm, matches


source = (eng.provider.manifest.get("model") or {}).get("source")
seed = (eng.provider.manifest.get("build") or {}).get("seed", 0)
from k3compile.model_def.config import PRESETS   # noqa: E402

if source in PRESETS:
    from k3compile.model_def.loader import load_model

    t0 = time.perf_counter()
    model = load_model(source, dtype=eng.provider.dtype, device=DEVICE, seed=seed, progress=False)
    say(f"model {source} (seed {seed}) loaded for recapture in {time.perf_counter() - t0:.1f} s")
    fixed = prompts(99, 1)[0]
    doc["p18"] = {}
    for on in (False, True):
        t0 = time.perf_counter()
        gm, matches = recaptured_prefill(on)
        eng.runner.executor._prefill = gm
        name = "p18_on" if on else "p18_off"
        say(f"{name}: prefill graph recaptured ({len(gm.graph.nodes)} nodes, P18 matches {matches}) in "
            f"{time.perf_counter() - t0:.1f} s")
        for p in prompts(3, 2):   # this graph's first contact with the shapes
            eng.generate([p], SamplingParams(max_new_tokens=2, ignore_eos=True))
        first = eng.generate([fixed], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
        doc["p18"][name] = {"matches": matches, "nodes": len(gm.graph.nodes), "first_tokens": first,
                            **arm(name, 30 + on), "profile": [profile_forward(257, name), profile_forward(16, name)]}
        save()
    same = doc["p18"]["p18_on"]["first_tokens"] == doc["p18"]["p18_off"]["first_tokens"]
    say(f"P18 on vs off: first tokens of a fixed prompt {'identical' if same else 'DIFFER'}")
    doc["p18"]["same_tokens"] = same
    save()
else:
    say(f"P18 A/B skipped: the engine's source {source!r} is not a preset")
say("done")
eng.close()
