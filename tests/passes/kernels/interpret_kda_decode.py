"""Run the fused KDA decode Triton kernel under TRITON_INTERPRET=1 on CPU and compare with the reference.

Started in a subprocess by test_kda_decode.py: Triton reads TRITON_INTERPRET when the kernel is
decorated, i.e. when kda_decode.py is first imported. Each case runs the kernel and the reference
on private copies of the same pools and compares the output and both pools (the slots the batch
touches, and that no other slot changed). Prints one line per failing case and exits 1 if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_kda_decode.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import arrivals, kda_decode  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)
from kda_decode_cases import make_case, rel_err  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
TILE_MAX = kda_decode.LOW_RANK_TILE_MAX


def cases():
    """(name, kwargs of make_case)"""
    for lb in (None, -5.0):
        variant = "Kimi-Linear softplus" if lb is None else "K3 lower bound"
        yield f"{variant} B=1", dict(batch=1, heads=2, head_dim=16, lower_bound=lb)
        yield f"{variant} B=3 slots reversed", dict(batch=3, heads=2, head_dim=16, lower_bound=lb, slots=[5, 2, 0])
        yield f"{variant} B=4 H=3 K=8 layer 1", dict(batch=4, heads=3, head_dim=8, lower_bound=lb, layer=1,
                                                     slots=[1, 6, 3, 4])
        yield f"{variant} bf16", dict(batch=3, heads=2, head_dim=16, lower_bound=lb, dtype=torch.bfloat16,
                                      slots=[4, 0, 2])
    yield "K=32 (non-trivial tile), strided x rows", dict(batch=2, heads=2, head_dim=32, lower_bound=-5.0,
                                                          strided_inputs=True, slots=[3, 1])
    yield "K=64: two V blocks, low-rank f and gate", dict(batch=2, heads=1, head_dim=64, lower_bound=None, f_rank=64,
                                                          g_rank=64, slots=[1, 0])
    yield "conv width 2", dict(batch=2, heads=2, head_dim=16, lower_bound=None, width=2, slots=[1, 0])
    yield "large forget logits (softplus identity branch)", dict(batch=2, heads=2, head_dim=16, lower_bound=None,
                                                                 f_scale=30.0, slots=[0, 3])
    yield "Kimi-Linear low-rank f and gate (R=16)", dict(batch=3, heads=2, head_dim=16, lower_bound=None, f_rank=16,
                                                         g_rank=16, slots=[2, 0, 4])
    yield "K3 low-rank f (R=40, not a power of 2), bf16", dict(batch=2, heads=2, head_dim=16, lower_bound=-5.0,
                                                              f_rank=40, dtype=torch.bfloat16, slots=[1, 3])
    yield "no requests", dict(batch=0, heads=2, head_dim=16, lower_bound=-5.0)
    # V split over several programs per head (the last part to arrive normalizes the head)
    for lb in (None, -5.0):
        variant = "Kimi-Linear softplus" if lb is None else "K3 lower bound"
        yield f"{variant} V split 2, B=3 slots reversed", dict(batch=3, heads=2, head_dim=16, lower_bound=lb,
                                                               slots=[5, 2, 0], v_split=2)
        yield f"{variant} V split 4, bf16, layer 1", dict(batch=2, heads=2, head_dim=16, lower_bound=lb, layer=1,
                                                          dtype=torch.bfloat16, slots=[1, 3], v_split=4)
    yield "V split 2 of K=32, low-rank f and gate", dict(
        batch=2, heads=1, head_dim=32, lower_bound=None, f_rank=32, g_rank=32, slots=[1, 0], v_split=2)
    yield "V split 4 of K=32, strided x rows", dict(batch=2, heads=2, head_dim=32, lower_bound=-5.0,
                                                     strided_inputs=True, slots=[3, 1], v_split=4)
    yield "V split 8 (2 columns a part), conv width 2", dict(batch=2, heads=2, head_dim=16, lower_bound=None,
                                                             width=2, slots=[1, 0], v_split=8)
    yield "V split 2, no requests", dict(batch=0, heads=2, head_dim=16, lower_bound=-5.0, v_split=2)
    # launch choices the bench sweeps: the wait-first schedule, other state block widths, chunked low rank
    yield "wait first (no prefetch), low-rank f and gate, V split 2", dict(
        batch=2, heads=2, head_dim=16, lower_bound=None, f_rank=16, g_rank=16, slots=[1, 0], v_split=2,
        launch=dict(prefetch=False))
    yield "block_v 8: 4 blocks per part of K=32, V split 1, low-rank f and gate", dict(
        batch=2, heads=1, head_dim=32, lower_bound=None, f_rank=32, g_rank=32, slots=[1, 0],
        launch=dict(block_v=8, num_warps=2))
    yield "block_v 4 within V split 2 of K=16, bf16", dict(
        batch=3, heads=2, head_dim=16, lower_bound=-5.0, dtype=torch.bfloat16, slots=[4, 0, 2], v_split=2,
        launch=dict(block_v=4))
    yield "launch layout s8 by name (K=64: V split 4, 16-column blocks), low-rank f and gate", dict(
        batch=1, heads=1, head_dim=64, lower_bound=None, f_rank=64, g_rank=64, slots=[1], launch=dict(layout="s8"))
    yield "low-rank weights in chunks (tile cap 0), V split 2", dict(
        batch=2, heads=2, head_dim=16, lower_bound=None, f_rank=40, g_rank=40, slots=[0, 2], v_split=2,
        tile_max=0)


def main() -> int:
    assert type(kda_decode._fused_kda_decode_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for name, kw in cases():
        n += 1
        v_split = kw.pop("v_split", None)
        launch = kw.pop("launch", {})
        kda_decode.LOW_RANK_TILE_MAX = kw.pop("tile_max", TILE_MAX)
        case = make_case(seed=n, **kw)
        ref_args, ker_args = case.args(), case.args()
        want = kda_decode.fused_kda_decode_reference(*ref_args)
        got = kda_decode.fused_kda_decode_triton(*ker_args, v_split=v_split, **launch)
        tol = TOL[case.dtype]
        problems = []
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"output {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}")
        else:
            for what, a, b in (("output", got, want), ("conv pool", ker_args[12], ref_args[12]),
                               ("ssm pool", ker_args[13], ref_args[13])):
                err = rel_err(a, b)
                if err > tol:
                    problems.append(f"{what} rel err {err:.3g} > {tol:g}")
            untouched = case.untouched_slots()
            for what, idx, orig in (("conv", 12, case.conv_pool), ("ssm", 13, case.ssm_pool)):
                if untouched and not torch.equal(ker_args[idx][untouched], orig[untouched]):
                    problems.append(f"{what} pool slots outside the batch changed")
        if v_split and case.slots.numel():  # the arrival counters are zero again for the next launch
            if arrivals.current("cpu", kda_decode.ARRIVALS_OWNER).any():
                problems.append("arrival counters not re-zeroed")
        failures += [f"{name}: {p}" for p in problems]
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
