"""Where the served path's time goes on a GPU (session 11, issue 9's served path): the engine `serve` builds,
in-process, without the HTTP layer, under cProfile.

Session 10 saw `serve ENGINE --enable-unified-memory` (k3-mini-6b) take 113.6 s to warm up and ~70 s for 16
short concurrent completions (tools/serve_check.py) right after. This loads the same engine directory with the
same EngineArgs as `serve` (unified memory, prefix cache on), then times and profiles:
  warm-up; round 1: 16 prompts of 16 distinct lengths, 16 new tokens each (serve_check's shape);
  round 2: the same 16 prompts again (prefix-cache hits); round 3: 16 new lengths.
A round much slower than the next one with the same shapes means lazy one-time work (compiles, autotuning).
    python tools/diag_serve11.py ENGINE_DIR [OUT_DIR]
Prints per phase the wall time and the top functions by cumulative and own time; writes diag_serve.txt.
"""
import cProfile
import io
import pstats
import sys
import time

import torch

from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams

engine_dir = sys.argv[1]
out = open((sys.argv[2] if len(sys.argv) > 2 else ".") + "/diag_serve.txt", "w")


def say(*a):
    print(*a, flush=True)
    print(*a, file=out, flush=True)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: checks the script on a k3-tiny engine


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def phase(name, fn):
    prof = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    prof.enable()
    result = fn()
    sync()
    prof.disable()
    say(f"== {name}: {time.perf_counter() - t0:.2f} s")
    for key, n in (("cumulative", 28), ("tottime", 14)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
        say("\n".join(l for l in s.getvalue().splitlines() if l.strip())[-6000:])
    return result


t0 = time.perf_counter()
eng = LLMEngine(EngineArgs(model=None, engine_dir=engine_dir, device=DEVICE, enable_unified_memory=True))
say(f"== engine built in {time.perf_counter() - t0:.2f} s")
phase("warm-up", eng.warmup)
params = SamplingParams(max_new_tokens=16, ignore_eos=True)
vocab = eng.config.vocab_size
lens1 = [5 + 3 * i for i in range(16)]
lens3 = [6 + 3 * i for i in range(16)]
p1 = [[(7 * i + 13 * j) % vocab for j in range(n)] for i, n in enumerate(lens1)]
p3 = [[(11 * i + 5 * j + 1) % vocab for j in range(n)] for i, n in enumerate(lens3)]
for name, prompts in (("round 1 (new lengths)", p1), ("round 2 (same prompts)", p1), ("round 3 (new lengths)", p3)):
    phase(name, lambda prompts=prompts: eng.generate(prompts, params))
say("metrics:", {k: v for k, v in eng.metrics().items() if k in ("cache_hit_tokens", "prefill_tokens", "generated_tokens")})
