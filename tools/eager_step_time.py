"""CPU seconds per eager decode step of a tiny model, with the `k3::` ops called directly (model_def's
`k3.NAME` in plain eager mode) and through the torch.library dispatcher, interleaved run by run.

    python tools/eager_step_time.py [--model k3-tiny] [--prompt 40] [--steps 40] [--reps 5]

Each run is one prefill and `--steps` single-request decode steps (the engine tests' reference loop); the
figure is process CPU time (user + sys) per decode step, the median over `--reps`, so other load on a
shared machine inflates both arms alike. Both arms must produce the same tokens (the script checks).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


@torch.no_grad()
def decode_run(model, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """(CPU seconds of the decode steps, the greedy tokens) for one request."""
    from k3compile.model_def.batch import ForwardBatch
    from k3compile.model_def.cache import CacheTensors

    page = 16
    n_pages = -(-(len(prompt) + steps + 1) // page)
    cache = CacheTensors.allocate(model.cache_spec(), 2, n_pages + 1, page, device="cpu")
    table, slot = list(range(1, n_pages + 1)), 1
    logits = model.step(ForwardBatch.build("prefill", [prompt], [0], [table], [slot], page), cache)[0]
    out = [int(logits.argmax())]
    start = time.process_time()
    for _ in range(steps):
        batch = ForwardBatch.build("decode", [[out[-1]]], [len(prompt) + len(out) - 1], [table], [slot], page)
        out.append(int(model.step(batch, cache)[0].argmax()))
    return time.process_time() - start, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens")
    p.add_argument("--steps", type=int, default=40, help="decode steps per run")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)

    from k3compile.model_def.loader import load_model
    from k3compile.model_def.ops import eager_dispatch

    torch.set_num_threads(1)  # as the test suite runs
    model = load_model(a.model)
    prompt = [random.Random(1).randrange(model.config.vocab_size) for _ in range(a.prompt)]
    direct = eager_dispatch.direct_device
    arms = {"direct": direct, "dispatcher": lambda args: None}
    times: dict[str, list[float]] = {name: [] for name in arms}
    tokens = {}
    decode_run(model, prompt, 4)  # warm-up: lazy inits, allocator
    for _ in range(a.reps):
        for name, choose in arms.items():
            eager_dispatch.direct_device = choose
            try:
                dt, tokens[name] = decode_run(model, prompt, a.steps)
            finally:
                eager_dispatch.direct_device = direct
            times[name].append(dt / a.steps)
    if tokens["direct"] != tokens["dispatcher"]:
        raise SystemExit(f"the arms disagree: {tokens['direct']} vs {tokens['dispatcher']}")
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    print(f"{a.model}, prompt {a.prompt}, {a.steps} decode steps x {a.reps} reps, CPU ms per decode step (median):")
    for name, v in ms.items():
        print(f"  {name:10s} {v:7.2f}   (runs: {', '.join(f'{t * 1e3:.2f}' for t in times[name])})")
    print(f"  direct / dispatcher = {ms['direct'] / ms['dispatcher']:.3f}; same tokens in both arms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
