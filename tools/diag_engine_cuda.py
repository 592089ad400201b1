"""Diagnostic (GPU): where the CUDA engine's greedy tokens leave the plain step loop's, per engine config,
and how close the reference's top-2 logits are there (a near tie means TF32 rounding, not a bug)."""
import dataclasses, random, sys
import torch
sys.path.insert(0, ".")
from tests.runtime.engine_helpers import GREEDY, make_engine, reference_generate, run_sequential, tokens
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.loader import load_model

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
model = load_model("k3-tiny", device=DEV)
rng = random.Random(51)
system = tokens(rng, 150)
seq = [system + tokens(rng, 9), system[:100] + tokens(rng, 40), system + tokens(rng, 30)]
refs = [reference_generate(model, p, 12) for p in seq]

@torch.no_grad()
def margins(prompt, out):
    full = prompt + out
    cache = CacheTensors.allocate(model.cache_spec(), 2, 64, 16, device=DEV)
    b = ForwardBatch.build("prefill", [full], [0], [list(range(1, 64))], [1], 16, device=DEV)
    b = dataclasses.replace(b, logits_indices=torch.arange(len(prompt) - 1, len(full) - 1, device=DEV))
    lg = model.step(b, cache).float()
    top = lg.topk(2, -1).values
    return [round(float(t[0] - t[1]), 5) for t in top]

print("reference min top-2 margin per request:", [min(margins(p, r)) for p, r in zip(seq, refs)], flush=True)
for cfg in [dict(chunk_size=32, page_size=1), dict(chunk_size=32, page_size=1, enable_unified_memory=True),
            dict(chunk_size=32, page_size=1, overlap=True), dict(overlap=True, enable_unified_memory=True, page_size=1, chunk_size=32)]:
    eng = make_engine(model, device=DEV, **cfg)
    got = run_sequential(eng, seq)
    eng.close()
    for i, (g, r) in enumerate(zip(got, refs)):
        if g != r:
            j = next(k for k in range(len(r)) if g[k] != r[k])
            print(cfg, f"request {i}: first diff at {j}; reference top-2 margins {margins(seq[i], r)[:j + 1]}")
    print(cfg, "identical" if got == refs else "differs", flush=True)
