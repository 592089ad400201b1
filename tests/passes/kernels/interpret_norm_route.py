"""Run the fused norm + router Triton kernel under TRITON_INTERPRET=1 on CPU and compare with the references.

Started in a subprocess by test_norm_route.py (TRITON_INTERPRET is read when the kernel is decorated). Per
case and per launch (two launches: the second finds the arrival counters zeroed again):
  * h and p are bit-equal to P7's own kernel on the same inputs (same code, same roundings), and h is within
    the normwise tolerance of the CPU reference (the interpreter rounds fp32 -> bf16 by truncation, so bf16
    cases get 3e-2 as in interpret_attn_res_norm.py);
  * the routing equals P4's absorbed reference on the kernel's h: ids equal (or swapped only between experts
    whose choice scores agree to 1e-6: the kernel sums the dot products in another order than torch.mm),
    weights to 1e-5;
  * every other routing tail (routing.ROUTE_TAILS, P7's `tail` option) gives bit-equal h, p, weights and ids to
    the default tail ("rounds") on the same inputs.
Exact-logit cases (router rows with one nonzero: every logit is one product, the same in any summation order, and
values repeat, so many choice scores tie exactly) check every tail's ids bit-equal to the reference (ties to the
lower expert index, groups too; where the reference's own sigmoid split an exact tie, the kernel's lower index) and
its weights to the reference within 1e-6.
With a front weight (norm_route_gemv's launch, pass p08_small_m_route_gemv): the same h, p and routing bit for bit, and
y = h @ W_f.T within one 16-bit rounding, for two front tilings.
Prints one line per failing case and exits 1 if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_norm_route.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import arrivals, norm_route, routing  # noqa: E402
from k3compile.passes.kernels import attn_res_norm as arn  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)


def cases():
    """(name, bank, x, delta, query, norm_weight, bias, router_weight, top_k, renorm, scaling, groups, topk_group,
    block_e)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    bf = torch.bfloat16
    # Kimi-Linear: residual add + RMSNorm, bf16 router weight (the checkpoint's), E=64 top-8, groups
    for n, block_e in ((1, None), (3, 4)):  # default blocks (1 expert/program here), then 4 experts/program
        yield (f"kimi-like N={n}", [], randn(n, 96, dtype=bf), randn(n, 96, dtype=bf), None, randn(96, dtype=bf),
               0.1 * randn(64), randn(64, 96, dtype=bf), 8, True, 2.446, 1, 1, block_e)
    yield ("groups 4 keep 2, no renorm, 8 experts/program", [], randn(2, 64, dtype=bf), randn(2, 64, dtype=bf), None,
           randn(64, dtype=bf), 0.1 * randn(64), randn(64, 64, dtype=bf), 6, False, 1.5, 4, 2, 8)
    # K3: AttnRes bank (1 and 3 rows), block boundary (delta None)
    for n, rows, block_e in ((1, 1, None), (3, 3, 8)):
        yield (f"k3-like bank={rows} N={n}", [randn(n, 64, dtype=bf) * (j + 1) for j in range(rows)],
               randn(n, 64, dtype=bf), randn(n, 64, dtype=bf), 0.05 * randn(64), randn(64, dtype=bf), 0.1 * randn(32),
               randn(32, 64, dtype=bf), 4, True, 1.0, 1, 1, block_e)
    yield ("k3-like bank=2 delta None, 1 program/token", [randn(2, 64, dtype=bf) for _ in range(2)],
           randn(2, 64, dtype=bf), None, 0.05 * randn(64), randn(64, dtype=bf), 0.1 * randn(32),
           randn(32, 64, dtype=bf), 4, True, 1.0, 1, 1, 32)
    # fp32 everything, a width that is not a power of two, fp32 router weight (P3's copy, when kept)
    yield ("fp32 D=100", [], randn(2, 100), randn(2, 100), None, randn(100), 0.1 * randn(16), randn(16, 100),
           2, True, 1.0, 1, 1, None)
    yield "no tokens", [], randn(0, 64, dtype=bf), randn(0, 64, dtype=bf), None, randn(64, dtype=bf), \
        0.1 * randn(16), randn(16, 64, dtype=bf), 2, True, 1.0, 1, 1, None


TAILS = list(routing.ROUTE_TAILS)  # "rounds" (the default) first


def exact_cases():
    """(name, x, router_weight, bias, top_k, renorm, scaling, groups, topk_group, block_e): bf16, no bank, exact
    logits with exact ties."""
    gen = torch.Generator().manual_seed(2)
    for name, e, d, k, groups, topk_group, block_e in (("E=64 k=8, 4 experts/program", 64, 32, 8, 1, 1, 4),
                                                       ("E=24 k=5, padded tile", 24, 16, 5, 1, 1, None),
                                                       ("groups 4 keep 2 k=6", 64, 32, 6, 4, 2, 8),
                                                       ("k=1", 16, 16, 1, 1, 1, 2)):
        col = torch.randint(0, 4, (e,), generator=gen)  # 4 source columns, 3 weight values: many equal logits
        w = torch.zeros(e, d)
        w[torch.arange(e), col] = torch.tensor([0.5, 1.0, -1.0])[torch.randint(0, 3, (e,), generator=gen)]
        bias = torch.tensor([0.0, 0.25])[torch.randint(0, 2, (e,), generator=gen)]  # exact sums with the scores
        x = torch.randn(2, d, generator=gen).bfloat16()
        yield name, x, w.bfloat16(), bias, k, True, 2.446, groups, topk_group, block_e


def _lower_of_true_ties(ids, ref_ids, h, w, bias) -> bool:
    """Where the ids differ, the two experts tie exactly (bit-equal logits and biases) and the kernel took the lower
    index. The reference can break such a tie the other way on some CPUs: torch's vectorized sigmoid gave two equal
    logits scores one ulp apart by their position in the row (session 16's machine: experts 2 and 14, logit
    0.4609375)."""
    logits = routing.router_logits(h.float(), w)
    differ = ids != ref_ids
    return (torch.equal(logits.gather(1, ids)[differ], logits.gather(1, ref_ids)[differ])
            and torch.equal(bias[ids][differ], bias[ref_ids][differ]) and bool((ids[differ] < ref_ids[differ]).all()))


def check_exact(name, x, w, bias, k, renorm, scale, groups, topk_group, block_e, failures):
    route = (k, renorm, scale, groups, topk_group)
    nw = torch.ones(x.shape[1], dtype=x.dtype)
    for tail in TAILS:
        h, _, weights, ids = norm_route.norm_route_triton([], x, None, None, nw, 1e-5, 1e-6, bias, w, *route,
                                                          block_e=block_e, tail=tail)
        ref_w, ref_ids = routing.linear_route_reference(h.float(), w, bias, *route)
        tag = f"exact {name} tail {tail}"
        if not torch.equal(ids, ref_ids) and not _lower_of_true_ties(ids, ref_ids, h, w, bias):
            failures.append(f"{tag}: ids differ\n kernel {ids.tolist()}\n ref    {ref_ids.tolist()}")
        elif not torch.allclose(weights, ref_w, rtol=0, atol=1e-6):
            failures.append(f"{tag}: weights differ: {weights.tolist()} vs {ref_w.tolist()}")
    return len(TAILS)


def check_tails(name, args, kwargs, base, failures):
    """Every non-default tail against the default one's outputs `base`, bit for bit (two launches each)."""
    for tail in TAILS[1:]:
        for launch in range(2):
            out = norm_route.norm_route_triton(*args, **kwargs, tail=tail)
            if not all(torch.equal(a, b) for a, b in zip(out, base)):
                failures.append(f"{name} tail {tail} launch {launch}: outputs differ from tail rounds")
            counters = arrivals.current(args[1].device, norm_route.ARRIVALS_OWNER)
            if counters is not None and counters.any():
                failures.append(f"{name} tail {tail} launch {launch}: arrival counters not zeroed again")
    return 2 * (len(TAILS) - 1)


def check(name, bank, x, delta, query, nw, bias, w, k, renorm, scale, groups, topk_group, block_e, failures):
    route = (k, renorm, scale, groups, topk_group)
    h0, p0, _, _ = norm_route.norm_route_reference(bank, x, delta, query, nw, 1e-5, 1e-6, bias, w, *route)
    h7, p7 = arn.attn_res_norm_triton(bank, x, delta, query, nw, 1e-5, 1e-6)  # P7's kernel
    for launch in range(2):
        h, p, weights, ids = norm_route.norm_route_triton(bank, x, delta, query, nw, 1e-5, 1e-6, bias, w, *route,
                                                          block_e=block_e)
        tag = f"{name} launch {launch}"
        counters = arrivals.current(x.device, norm_route.ARRIVALS_OWNER)
        if counters is not None and counters.any():
            failures.append(f"{tag}: arrival counters not zeroed again")
            continue
        if not (torch.equal(h, h7) and torch.equal(p, p7)):
            failures.append(f"{tag}: h / p differ from P7's kernel")
            continue
        if x.shape[0]:
            tol = 1e-5 if x.dtype == torch.float32 else 3e-2
            err = ((h.float() - h0.float()).abs().max() / h0.float().abs().max()).item()
            if err > tol:
                failures.append(f"{tag}: h rel err {err:.2e} vs the reference > {tol}")
        ref_w, ref_ids = routing.linear_route_reference(h.float(), w, bias, *route)
        if ids.dtype != torch.int64 or weights.dtype != torch.float32:
            failures.append(f"{tag}: dtypes {weights.dtype}, {ids.dtype}")
        elif not torch.equal(ids, ref_ids):
            choice = routing.router_logits(h.float(), w).sigmoid() + bias.float()
            if not torch.allclose(choice.gather(1, ids), choice.gather(1, ref_ids), rtol=0, atol=1e-6):
                failures.append(f"{tag}: ids differ\n kernel {ids.tolist()}\n ref    {ref_ids.tolist()}")
        else:
            try:
                torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
            except AssertionError as err:
                failures.append(f"{tag}: weights differ: {err}")
    args = (bank, x, delta, query, nw, 1e-5, 1e-6, bias, w, *route)
    return 2 + check_tails(name, args, dict(block_e=block_e), (h, p, weights, ids), failures)


def check_front(name, bank, x, delta, query, nw, bias, w, k, renorm, scale, groups, topk_group, block_e, failures):
    """norm_route_gemv's launch (the router's programs plus the front GEMV's): h, p, weights and ids bit-equal to the
    launch without the front; y = h @ W_f.T within one 16-bit rounding of the fp32 product of the kernel's own h,
    element by element, for the default rows per program and a ragged 4-row tile."""
    route = (k, renorm, scale, groups, topk_group)
    gen = torch.Generator().manual_seed(x.shape[0] * 7 + x.shape[1])
    wf = torch.randn(40, x.shape[1], generator=gen).to(x.dtype)  # 40 rows: 10 blocks of 4, or one padded tile
    base = norm_route.norm_route_triton(bank, x, delta, query, nw, 1e-5, 1e-6, bias, w, *route, block_e=block_e)
    n = 0
    for front_block in (None, 4):
        for launch in range(2):
            out = norm_route.norm_route_triton(bank, x, delta, query, nw, 1e-5, 1e-6, bias, w, *route,
                                               block_e=block_e, front_weight=wf, front_block=front_block)
            n += 1
            tag = f"front {name} block {front_block} launch {launch}"
            if len(out) != 5 or not all(torch.equal(a, b) for a, b in zip(out[:4], base)):
                failures.append(f"{tag}: h, p, weights or ids differ from the launch without the front")
                continue
            y = out[4]
            if y.shape != (x.shape[0], 40) or y.dtype != x.dtype:
                failures.append(f"{tag}: y is {tuple(y.shape)} {y.dtype}")
                continue
            if x.shape[0]:
                want = out[0].float() @ wf.float().t()
                # each element within one 16-bit rounding of the fp32 product (the interpreter truncates: < 2^-7
                # of the value), plus the fp32 sums' order (1e-5 of the largest)
                ulp = 0.0 if x.dtype == torch.float32 else 2.0 ** -7
                excess = (y.float() - want).abs() - ulp * want.abs() - 1e-5 * want.abs().max()
                if excess.max().item() > 0:
                    failures.append(f"{tag}: y off the fp32 product by more than one rounding "
                                    f"(by {excess.max().item():.2e} at worst)")
            counters = arrivals.current(x.device, norm_route.ARRIVALS_OWNER)
            if counters is not None and counters.any():
                failures.append(f"{tag}: arrival counters not zeroed again")
    return n


def main() -> int:
    assert type(norm_route._norm_route_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for case in cases():
        n += check(*case, failures)
        n += check_front(*case, failures)
    for case in exact_cases():
        n += check_exact(*case, failures)
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
