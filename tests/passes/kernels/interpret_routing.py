"""Run the fused-routing Triton kernel under TRITON_INTERPRET=1 on CPU and compare with the reference.

Started in a subprocess by test_routing.py: Triton reads TRITON_INTERPRET when the kernel is
decorated, i.e. when routing.py is first imported, and a pytest process may already have imported
it (or triton) without the flag. Prints one line per failing case and exits 1 if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_routing.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import arrivals, routing  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)

WEIGHT_ATOL = 1e-6


def cases():
    """(name, logits, bias, top_k, renormalize, scaling, num_expert_group, topk_group)"""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    for t in (1, 3, 17):
        for e in (8, 64, 96):
            for k in (1, 2, 8):
                yield f"grid T={t} E={e} k={k}", randn(t, e), 0.1 * randn(e), k, True, 2.446, 1, 1
    yield "no renorm", randn(5, 64), 0.1 * randn(64), 8, False, 2.827, 1, 1
    yield "k == E", randn(3, 8), 0.1 * randn(8), 8, True, 1.0, 1, 1
    yield "groups 4 keep 2", randn(5, 64), 0.1 * randn(64), 8, True, 2.446, 4, 2
    yield "groups 8 keep 3 (E=96)", randn(3, 96), 0.1 * randn(96), 6, False, 1.0, 8, 3
    yield "groups 2 keep 1", randn(4, 64), 0.1 * randn(64), 16, True, 1.0, 2, 1
    yield "all tied", torch.zeros(3, 64), torch.zeros(64), 8, True, 1.0, 1, 1
    tied = randn(4, 96).round()  # few distinct values: many exact ties
    yield "partial ties", tied, torch.zeros(96), 8, True, 1.0, 1, 1
    yield "tied groups", torch.zeros(2, 64), torch.zeros(64), 8, True, 1.0, 8, 2
    big = torch.zeros(64)
    big[[3, 40, 63]] = 100.0
    yield "large bias", randn(3, 64) - 5.0, big, 4, True, 2.446, 1, 1
    yield "bf16 logits", randn(17, 96).bfloat16(), 0.1 * randn(96), 8, True, 2.446, 1, 1
    yield "fp16 logits, bf16 bias", randn(3, 64).half(), (0.1 * randn(64)).bfloat16(), 2, True, 1.0, 1, 1
    nan = randn(3, 64)
    nan[1, 5] = float("nan")
    yield "NaN logit", nan, 0.1 * randn(64), 4, True, 1.0, 1, 1
    wide = randn(3, 70)
    yield "strided rows", wide[:, :64], 0.1 * randn(64), 8, True, 1.0, 1, 1
    yield "no tokens", randn(0, 64), 0.1 * randn(64), 8, True, 1.0, 1, 1
    yield "K3 shape E=896 k=16", randn(2, 896), 0.01 * randn(896), 16, True, 1.0, 1, 1


def linear_cases():
    """(name, x, weight, bias, top_k, renormalize, scaling, num_expert_group, topk_group, blocks): the absorbed
    form (router GEMM + routing in one launch). blocks: (block_e, block_d) or None for the defaults."""
    gen = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    yield "T=3 E=64 k=8 default blocks", randn(3, 48), randn(64, 48), 0.1 * randn(64), 8, True, 2.446, 1, 1, None
    yield "T=5 E=64 k=6, 4 experts/program, D split", randn(5, 40).bfloat16(), randn(64, 40), 0.1 * randn(64), \
        6, True, 2.446, 1, 1, (4, 16)
    yield "groups 4 keep 2, no renorm", randn(4, 32), randn(64, 32), 0.1 * randn(64), 8, False, 1.5, 4, 2, (8, 32)
    yield "bf16 weight, 1 program/token", randn(2, 24).bfloat16(), randn(16, 24).bfloat16(), 0.1 * randn(16), \
        2, True, 1.0, 1, 1, (16, 32)
    wide = randn(3, 40)
    yield "strided x rows", wide[:, :32], randn(96, 32), 0.1 * randn(96), 8, True, 1.0, 8, 3, (16, 8)


def check_linear(failures: list) -> int:
    n = 0
    for name, x, w, bias, k, renorm, scale, groups, topk_group, blocks in linear_cases():
        block_e, block_d = blocks or (None, None)
        ref_weights, ref_ids = routing.linear_route_reference(x, w, bias, k, renorm, scale, groups, topk_group)
        for launch in range(2):  # the second launch finds the arrival counters zeroed again
            n += 1
            weights, ids = routing.linear_route_triton(x, w, bias, k, renorm, scale, groups, topk_group,
                                                       block_e=block_e, block_d=block_d)
            counters = arrivals.current(x.device, routing.ARRIVALS_OWNER)
            if counters is not None and counters.any():
                failures.append(f"linear {name} launch {launch}: arrival counters not zeroed again")
            elif not torch.equal(ids, ref_ids):
                # the kernel's fp32 dot products sum in another order than torch.mm: accept swaps of experts
                # whose reference choice scores agree to 1e-6 (an ulp or two), slot by slot
                choice = routing.router_logits(x, w).sigmoid() + bias.float()
                if not torch.allclose(choice.gather(1, ids), choice.gather(1, ref_ids), rtol=0, atol=1e-6):
                    failures.append(f"linear {name} launch {launch}: ids differ\n kernel {ids.tolist()}\n"
                                    f" ref    {ref_ids.tolist()}")
            else:
                try:
                    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
                except AssertionError as err:
                    failures.append(f"linear {name} launch {launch}: weights differ: {err}")
    return n


def main() -> int:
    assert type(routing._fused_route_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures = []
    n = check_linear(failures)
    for name, logits, bias, k, renorm, scale, groups, topk_group in cases():
        n += 1
        args = (logits, bias, k, renorm, scale, groups, topk_group)
        weights, ids = routing.route_triton(*args)
        ref_weights, ref_ids = routing.route_reference(*args)
        if ids.dtype != torch.int64 or weights.dtype != torch.float32:
            failures.append(f"{name}: dtypes {weights.dtype}, {ids.dtype}")
        elif not torch.equal(ids, ref_ids):
            failures.append(f"{name}: ids differ\n kernel {ids.tolist()}\n ref    {ref_ids.tolist()}")
        else:
            try:
                torch.testing.assert_close(weights, ref_weights, rtol=0, atol=WEIGHT_ATOL, equal_nan=True)
            except AssertionError as err:
                failures.append(f"{name}: weights differ: {err}")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
