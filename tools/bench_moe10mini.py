"""k3-mini-6b's latent MoE: launch sweep of its three kernels (issue 9, helper mini10).

Shape: one MoE layer of k3-mini-6b (model_def preset: E=96, top-8, I=512 on the 1024-wide latent, RMSNorm + up-
projection to hidden 2048, num_shared_experts x I = 1024 shared width, SiTU), bf16 experts, batch 1, 8, 2, 4; the op
as P6 emits it for that model: latent path (kernel A "rows", kernel B' "split" storing u in fp32, kernel C
`_latent_out_kernel` with the norm, the up-projection and the shared expert's down-projection with its GLU on the
shared gate/up columns the layer's GEMM made), PDL on. Each timed call cycles over ROUTINGS argument sets (bench_moe8's
harness: different random routings, x and shared inputs, each with its own copy of W_up, the norm weight and the shared
W2), so a replay does not find the previous call's weights in L2. The sweep itself is tools/bench_moe_sweep.py's.

Arms per batch: "today" (the launches moe_decode picks as committed), then one kernel varied at a time over
moe_launch.ROWS_CANDIDATES (A), LATENT_SPLIT_CANDIDATES (B'), LATENT_CANDIDATES (C), then "combo": each kernel's
fastest launch (op µs) together. A's and B''s launches go in through the op's up_launch / split arguments, C's through
its table (a LATENT_TUNED entry set for the call).

Per (batch, arm): op µs (calls replayed from one CUDA graph, PDL on: graph_timing.replay_us); A, B', C device µs from
torch.profiler (eager, PDL on), each kernel's bytes (bench_moe_kernels.kernel_bytes: distinct experts' rows, W_up, the
shared W2, activations) as % of the same-run copy bandwidth; rel err vs the fp32 reference. Then per batch: today vs
the fastest arm, and the python table entries that make the winner the default. Results are saved after every arm,
a batch starts only while the time budget (argv[2] s, default 80) lasts and stops its arms GRACE_S after it (the
fastest of what it measured still reported): a timeout keeps what is saved.
Writes mini10.md and mini10.json to OUT (argv[1]).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

from k3compile.model_def.config import get_preset
from k3compile.passes.kernels import moe_decode, moe_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_sweep import ROUTINGS, Shape, sweep  # noqa: E402

SHAPE = "k3-mini-6b"
DEVICE = "cuda"


class MiniLatent(Shape):
    stem = "mini10"
    batches = (1, 8, 2, 4)  # batch 1 (the goal) and 8 (must not regress) first
    # A, B (kernel B', the split down-projection) and C by kernel_times' names
    kernels = {"A": "_expert_up_kernel", "B": "_expert_down_kernel", "C": "_latent_out_kernel"}
    header = (f"{SHAPE} latent MoE layer, bf16 experts, kernels A (rows) + B' (split) + C (latent out, shared expert). "
              "Launches: A (BLOCK_N, BLOCK_K, warps), B' (BLOCK_N, BLOCK_K, warps, K chunks, prefetch), C (BLOCK_N, "
              "BLOCK_K, BLOCK_KS, warps)")

    def __init__(self, gen):
        cfg = get_preset(SHAPE)
        e, k, i, lat, d = (cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.latent_size,
                           cfg.hidden_size)
        s = i * cfg.num_shared_experts

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).bfloat16()
        tails = [dict(shared_w2=randn(d, s, scale=s ** -0.5), up_w=randn(d, lat, scale=lat ** -0.5),
                      norm_w=(1 + 0.1 * torch.randn(lat, generator=gen, device=DEVICE)).bfloat16())
                 for _ in range(ROUTINGS)]
        self.spec = dict(name=SHAPE, e=e, k=k, i=i, s=s, d_in=lat, d_out=d, up_w=True, tails=tails,
                         act=cfg.hidden_act, w13=randn(e, 2 * i, lat, scale=lat ** -0.5),
                         w2=randn(e, lat, i, scale=i ** -0.5))

    def args(self, n, r, ids, wts, gen):
        spec, tail = self.spec, self.spec["tails"][r]
        x = torch.randn(n, spec["d_in"], generator=gen, device=DEVICE).bfloat16()
        g, u = (torch.randn(n, spec["s"], generator=gen, device=DEVICE).bfloat16() for _ in range(2))
        return dict(x=x, topk_ids=ids, topk_weights=wts, w13=spec["w13"], w2=spec["w2"], shared_in=g, shared_up=u,
                    shared_w2=tail["shared_w2"], act=spec["act"], beta=4.0, linear_beta=25.0,
                    latent_up_w=tail["up_w"], latent_norm_w=tail["norm_w"], latent_eps=1e-5)

    def keys(self, n) -> dict:
        """The table keys of this shape at batch n: A's ROWS_TUNED, B''s SPLIT_TUNED, C's LATENT_TUNED."""
        spec = self.spec
        return {"A": ("up", n * spec["k"], spec["i"], spec["d_in"]),
                "B": (n * spec["k"], spec["d_in"], spec["i"], False), "C": (n, spec["d_out"], spec["d_in"], spec["s"])}

    def today(self, n) -> dict:
        """The launches the op makes as committed (no bench override)."""
        kk = self.keys(n)
        kernel, pairs, rows, width = kk["A"]
        return {"A": moe_launch.rows_config(pairs, rows, pairs, kernel, width),
                "B": moe_launch.split_config(*kk["B"]), "C": moe_launch.latent_config(*kk["C"])}

    def arms(self, n, best):
        """Each candidate of one kernel with the other two as today."""
        base = {key: list(v) for key, v in self.today(n).items()}
        out = []
        for kernel, cands in (("A", moe_launch.ROWS_CANDIDATES), ("B", moe_launch.LATENT_SPLIT_CANDIDATES),
                              ("C", moe_launch.LATENT_CANDIDATES)):
            out += [(kernel, dict(base, **{kernel: list(c)})) for c in cands if list(c) != base[kernel]]
        return out

    @contextlib.contextmanager
    def latent_table(self, n, launch):
        """LATENT_TUNED holds `launch` (kernel C) for this shape while the op runs (C has no launch argument)."""
        key = self.keys(n)["C"]
        saved = moe_launch.LATENT_TUNED.get(key)
        moe_launch.LATENT_TUNED[key] = moe_launch.LatentConfig(*launch)
        try:
            yield
        finally:
            moe_launch.LATENT_TUNED.pop(key)
            if saved is not None:
                moe_launch.LATENT_TUNED[key] = saved

    def run(self, n, kw, launches):
        with self.latent_table(n, launches["C"]):
            return moe_decode.fused_moe_triton(**kw, use_pdl=True, designs=("rows", "split"),
                                               up_launch=launches["A"], split=moe_launch.SplitConfig(*launches["B"]))

    def entries(self, n, launches) -> list[str]:
        """The python table entries (moe_decode.py) that make `launches` the default at batch n."""
        kk, base, lines = self.keys(n), self.today(n), super().entries(n, launches)
        if tuple(launches["C"]) != tuple(base["C"]):
            lines.append(f"LATENT_TUNED: {kk['C']!r}: {moe_launch.LatentConfig(*launches['C'])!r},")
        return lines


def main(out_dir: str, budget_s: float) -> None:
    if moe_launch.kernel_designs(1, False) != ("rows", "split"):
        print(f"note: kernel_designs(1) is {moe_launch.kernel_designs(1, False)}; this sweep runs rows + split")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    sweep(MiniLatent(gen), out_dir, budget_s)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."),
         float(sys.argv[2]) if len(sys.argv) > 2 else 80.0)
