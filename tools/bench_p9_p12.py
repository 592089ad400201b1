"""P9 and P12 on one GPU (NCCL world size 1, so the all-reduce is NCCL's one-rank kernel): each fused collective
op against the composite it replaces, CUDA-event timed (median of 200 after 20 warm-up calls), plus the
numerics. Usage: python3 tools/bench_p9_p12.py OUT_DIR. Writes OUT_DIR/p9_p12.txt.

P9:  composite = k3.all_reduce (staging copy + NCCL) then k3.attn_res_norm (P7's Triton kernel)
     fused     = k3.all_reduce_attn_res_norm (NCCL in place on the partial, then P7's kernel)
P12: composite = k3.moe_experts (grouped GEMMs + scatter of the weighted rows) + shared add, then k3.all_reduce
     fused     = k3.moe_expert_rows (grouped GEMMs) then k3.moe_finalize_all_reduce (Triton finalize into the
                 buffer + NCCL in place)
At world 1 the reduction moves no data, so this measures what the fusion removes (copies, kernels), not
NVLink time."""
import os
import statistics
import sys

import torch

from k3compile.model_def.ops import library  # noqa: F401
from k3compile.model_def.parallel.topology import Topology
from k3compile.passes.kernels import all_reduce_norm, moe_finalize  # noqa: F401
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import free_port


def timed(fn, iters=200, warm=20):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def p9(lines):
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 8, 64, 512):
        for d, bank_rows in ((7168, 8), (2048, 4)):
            r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
            x, part, bank = r(n, d), r(n, d), [r(n, d) for _ in range(bank_rows)]
            query, weight = torch.randn(d, device="cuda", generator=g), r(d)
            args = (query, weight, 1e-5, 1e-6)
            comp = lambda: torch.ops.k3.attn_res_norm(bank, x, torch.ops.k3.all_reduce(part, "world"), *args)  # noqa
            fused = lambda: torch.ops.k3.all_reduce_attn_res_norm(bank, x, part, *args, "world")  # noqa: E731
            err = rel(fused()[0], comp()[0])
            lines.append(f"P9  N={n:4d} D={d} bank={bank_rows}: composite {timed(comp):8.1f} us  fused "
                         f"{timed(fused):8.1f} us  h rel err {err:.1e}")


def p12(lines):
    g = torch.Generator(device="cuda").manual_seed(1)
    e, k, d, inter = 48, 8, 2048, 512  # K3-like latent MoE slice on one rank of 8 (EP)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    w2 = (torch.randn(e, d, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    for n in (64, 512, 2048):
        x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        ids = torch.randint(0, e, (n, k), device="cuda", generator=g)
        wts = torch.rand(n, k, device="cuda", generator=g)
        shared = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        act = ("silu", 1.0, 1.0)

        def comp():
            y = torch.ops.k3.moe_experts(x, ids, wts, w13, w2, *act) + shared
            return torch.ops.k3.all_reduce(y, "world")

        def fused():
            rows, slots = torch.ops.k3.moe_expert_rows(x, ids, w13, w2, *act)
            return torch.ops.k3.moe_finalize_all_reduce(rows, slots, wts, shared, "world")

        rows, slots = torch.ops.k3.moe_expert_rows(x, ids, w13, w2, *act)
        fin_only = lambda: torch.ops.k3.moe_finalize_all_reduce(rows, slots, wts, shared, "world")  # noqa: E731
        err = rel(fused(), comp())
        lines.append(f"P12 N={n:4d} E={e} k={k} D={d} I={inter}: composite {timed(comp):8.1f} us  fused "
                     f"{timed(fused):8.1f} us  (finalize+all-reduce alone {timed(fin_only):7.1f} us)  rel err {err:.1e}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    init_rank(Topology(1, 1), "nccl", timeout_s=60, device_id=torch.device("cuda:0"))
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__}"]
    try:
        p9(lines)
        p12(lines)
    finally:
        shutdown_rank()
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "p9_p12.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
