"""Run the GEMV-chain Triton kernel under TRITON_INTERPRET=1 on CPU against separate GEMMs.

Started in a subprocess by test_gemv_chain.py (TRITON_INTERPRET is read when the kernel is decorated).
Prints one line per failing case and exits 1 if any failed."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_gemv_chain.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels.gemv_chain import GemvChain  # noqa: E402
import interpreted  # noqa: E402  (its shim: no re-patching of triton.language inside a launch; sys.path[0])

TOL = 1e-2  # bf16 outputs: each stage rounds an fp32 sum once


def cases():
    # (name, m, widths: K_1, N_1, ..., N_S, block_n, block_k): ragged last tiles in N and K, one and several stages
    yield "one stage", 1, (96, 40), 4, 32
    yield "three stages, ragged", 1, (72, 40, 130, 24), 4, 32
    yield "M=3, block_n 2", 3, (64, 48, 64), 2, 16
    yield "M=4, wide tiles", 4, (200, 33, 96), 16, 64
    yield "block_k over K", 2, (24, 40, 20), 8, 64
    yield "M=1, eight stages", 1, (64,) * 9, 4, 32


gen = torch.Generator().manual_seed(0)
failures, n = [], 0
for (name, m, widths, bn, bk), persistent in [(c, p) for c in cases() for p in (False, True)]:
    n += 1
    name += " (persistent)" if persistent else ""
    weights = [torch.randn(widths[i + 1], widths[i], generator=gen).bfloat16() for i in range(len(widths) - 1)]
    x = torch.randn(m, widths[0], generator=gen).bfloat16()
    chain = GemvChain(weights, m, block_n=bn, block_k=bk, persistent=persistent)
    chain.input.copy_(x)
    tiles = [int(b - a) for a, b in zip(chain.prefix[:-1], chain.prefix[1:])]
    for rep in range(3):  # the later launches wait for the counts the earlier ones left
        chain.launch()
        # the persistent form takes no tickets: its epoch comes from the last stage's count
        want_ctr = [0 if persistent else (rep + 1) * chain.tiles] + [(rep + 1) * t for t in tiles]
        if chain.counters.tolist() != want_ctr:
            failures.append(f"{name} (launch {rep + 1}): counters {chain.counters.tolist()}, want {want_ctr}")
        # each stage against the exact product of the kernel's own previous output (and, from there, aten's bf16 mm)
        prev = x
        for s, (w, got) in enumerate(zip(weights, chain.outputs)):
            exact = prev.double() @ w.double().t()
            want = torch.mm(prev, w.t())
            err = max(float((got.double() - exact).abs().max() / exact.abs().max()),
                      float((want.double() - exact).abs().max() / exact.abs().max()))
            if got.shape != want.shape or not err <= TOL:
                failures.append(f"{name} (launch {rep + 1}) stage {s + 1}: rel err {err:.3g}, {tuple(got.shape)}")
            prev = got.clone()
for line in failures:
    print("FAIL", line)
print(f"{n - len(failures)}/{n} cases match")
sys.exit(1 if failures else 0)
