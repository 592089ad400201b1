"""Diagnostic (GPU): where the CUDA engine's greedy tokens leave the plain step loop's, per engine config,
and how close the reference's top-2 logits are there (a near tie means TF32 rounding, not a bug).

    python3 tools/diag_engine_cuda.py [cuda|cpu]
"""
import random
import sys

sys.path.insert(0, ".")
from k3compile.model_def.loader import load_model  # noqa: E402
from tests.runtime.engine_helpers import make_engine, reference_generate, reference_top2, run_sequential, tokens  # noqa: E402

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
model = load_model("k3-tiny", device=DEV)
rng = random.Random(51)
system = tokens(rng, 150)
seq = [system + tokens(rng, 9), system[:100] + tokens(rng, 40), system + tokens(rng, 30)]
refs = [reference_generate(model, p, 12) for p in seq]
print("reference min top-2 margin per request:", [min(reference_top2(model, p, r)[0]) for p, r in zip(seq, refs)])
for cfg in [dict(chunk_size=32, page_size=1), dict(chunk_size=32, page_size=1, enable_unified_memory=True),
            dict(chunk_size=32, page_size=1, overlap=True),
            dict(overlap=True, enable_unified_memory=True, page_size=1, chunk_size=32)]:
    eng = make_engine(model, device=DEV, **cfg)
    got = run_sequential(eng, seq)
    eng.close()
    for i, (g, r) in enumerate(zip(got, refs)):
        if g != r:
            j = next(k for k in range(len(r)) if g[k] != r[k])
            print(cfg, f"request {i}: first diff at {j}; reference top-2 margins "
                       f"{[round(m, 5) for m in reference_top2(model, seq[i], r)[0][:j + 1]]}")
    print(cfg, "identical" if got == refs else "differs", flush=True)
