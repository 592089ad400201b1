"""Run the ReplaySSM fold kernel under TRITON_INTERPRET=1 on CPU against the torch reference.

Started in a subprocess by test_fold_kernel.py (Triton reads the flag when the kernel is decorated).
The interpreter reduces with numpy, in another order than torch, so states are compared to fp32
rounding here; bit-identity with the decode kernel is a GPU test (test_fold_gpu.py).
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_fold.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import tests.passes.kernels.interpreted  # noqa: E402,F401  (the interpreter's helper calls without re-patching)
from k3compile.model_def.cache import CacheSpec, CacheTensors  # noqa: E402
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec  # noqa: E402
from k3compile.model_def.ops import kda_math  # noqa: E402
from k3compile.runtime.spec import fold_kernel  # noqa: E402


def case(heads, head_dim, n_kda, length, slots, accept, dtype, seed):
    spec = CacheSpec(n_kda=n_kda, kda_heads=heads, kda_head_k=head_dim, kda_head_v=head_dim,
                     conv_channels=3 * heads * head_dim, conv_window=3, n_mla=1, kv_width=8, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    cache = CacheTensors.allocate(spec, max(slots) + 2, 1, 4)
    cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=gen) * 0.3)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen).to(dtype))
    w = DraftWindow.allocate(DraftWindowSpec(spec, length), len(slots))
    w.k.copy_(torch.randn(w.k.shape, generator=gen).to(dtype))
    w.v.copy_(torch.randn(w.v.shape, generator=gen).to(dtype))
    w.g.copy_(kda_math.kda_gate(torch.randn(w.g.shape, generator=gen).flatten(-2), torch.zeros(heads),
                                torch.zeros(heads * head_dim), head_dim, -5.0))
    w.beta.copy_(torch.rand(w.beta.shape, generator=gen))
    w.x.copy_(torch.randn(w.x.shape, generator=gen).to(dtype))
    ref = CacheTensors.allocate(spec, max(slots) + 2, 1, 4)
    ref.ssm.copy_(cache.ssm)
    ref.conv.copy_(cache.conv)
    fold_kernel.fold_reference(ref, w, slots, accept)
    fold_kernel.commit(cache, w, slots, accept, use_kernel=True)
    err = ((cache.ssm - ref.ssm).abs().max() / ref.ssm.abs().max()).item()
    return err < 2e-6 and torch.equal(cache.conv, ref.conv), err


CASES = [
    ("H=2 K=16 two layers", dict(heads=2, head_dim=16, n_kda=2, length=5, slots=[3, 1, 4], accept=[1, 5, 3])),
    ("a request accepting nothing", dict(heads=2, head_dim=16, n_kda=1, length=4, slots=[0, 2], accept=[0, 2])),
    ("K=64: two column blocks", dict(heads=1, head_dim=64, n_kda=2, length=3, slots=[1, 0], accept=[3, 2])),
    ("bf16 window", dict(heads=2, head_dim=16, n_kda=2, length=4, slots=[2, 0], accept=[4, 1], dtype=torch.bfloat16)),
]

failures = []
for name, kw in CASES:
    ok, err = case(dtype=kw.pop("dtype", torch.float32), seed=len(failures), **kw)
    if not ok:
        failures.append(f"{name}: rel err {err:.2e}")

# P5 decode vs verify inputs (kda_verify_inputs.py) + fold, as the GPU test runs it
from tests.runtime.spec.test_fold_gpu import decode_vs_fold  # noqa: E402

# K=64: V split 4 with 16-column blocks (K=16: no split); the layout name reaches P5's
# launch, the verify inputs and the fold alike
P5_CASES = [(16, torch.float32, -5.0, "s8"), (16, torch.float32, None, "s8"), (64, torch.float32, None, "s8")]
for hd, dt, lb, layout in P5_CASES:
    # batch 3 (the GPU test runs 4): accepts 1, 6, 3 still give decode steps of 3, 2 and 1 rows and the same
    # V split; the interpreter's time grows with the programs (batch 4 -> 3: 16 -> 11 CPU s per case)
    a, b = decode_vs_fold(hd, dt, lb, dev="cpu", batch=3, layout=layout)
    err = ((a.ssm - b.ssm).abs().max() / a.ssm.abs().max()).item()
    if not (err < 2e-6 and torch.equal(a.conv, b.conv)):
        failures.append(f"P5 decode vs fold K={hd} {dt} lower_bound={lb} layout {layout}: rel err {err:.2e}")
CASES += P5_CASES
for line in failures:
    print("FAIL", line)
print(f"{len(CASES) - len(failures)}/{len(CASES)} cases match")
sys.exit(1 if failures else 0)
