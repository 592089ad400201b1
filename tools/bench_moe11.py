"""Kimi-Linear-48B's MoE at batch 1 and 8: launch sweep of kernels A and B', and flag_deps (issue 9, helper moe11).

Shape: one MoE layer of kimi-linear-48b (model_def preset: E=256, top-8, I=1024, D=2304, one shared expert, SiLU), bf16
experts; the op as P6 emits it for that model: full width, the shared expert's gate/up as kernel A's shared slot
(shared_w13), kernel A "rows", B' "split" with the shared expert's down-projection, shared_l2_prefetch and
down_l2_prefetch on (P6's defaults), PDL on. Each timed call cycles over ROUTINGS argument sets (random routings, x,
and per-set copies of the shared expert's weights), so a replay does not find the previous call's weights in L2.

Launch keys: "A" kernel A's (BLOCK_N, BLOCK_K, warps), "B" B''s SplitConfig (BLOCK_N, BLOCK_K, warps, K chunks,
prefetch), "F" flag_deps (0/1). Arms per batch (tools/bench_moe_sweep.py's harness): today; an earlier batch's winning
values first; A over moe_launch.FULL_ROWS_CANDIDATES; F on at today's B', then with FLAG_SPLIT_CANDIDATES (K chunks:
a B' program waits for part of its h row); B over SPLIT_CANDIDATES; then the combination of each key's fastest value.
A and B' go in through the op's up_launch / split arguments (what P6's up_launch / down_split options pass).

Prints the table, per batch the table entries and P6 options for the fastest arm, and the `bench ladder --variant`
strings that A/B them whole-engine. Writes moe11.md and moe11.json to OUT (argv[1]); argv[2]: time budget s (default
75); argv[3]: batches, comma list (default 1,8).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from k3compile.model_def.config import get_preset
from k3compile.passes.kernels import moe_decode, moe_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_sweep import ROUTINGS, Shape, sweep  # noqa: E402

MODEL = "kimi-linear-48b"
DEVICE = "cuda"
P6 = "p06_fused_moe_decode"


class FullWidth(Shape):
    stem = "moe11"
    batches = (1, 8)
    kernels = {"A": "_expert_up_kernel", "B": "_expert_down_kernel"}  # kernel_times' names (rows / split designs)
    header = (f"{MODEL} MoE layer (full width, shared slot in A, L2 options on), bf16 experts, kernels A (rows) + B' "
              "(split). Launches: A (BLOCK_N, BLOCK_K, warps), B (BLOCK_N, BLOCK_K, warps, K chunks, prefetch), "
              "F flag_deps")

    def __init__(self, gen):
        cfg = get_preset(MODEL)
        e, k, i, d = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.hidden_size
        s = i * cfg.num_shared_experts

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).bfloat16()
        shared = [dict(w13=randn(2 * s, d, scale=d ** -0.5), w2=randn(d, s, scale=s ** -0.5)) for _ in range(ROUTINGS)]
        self.spec = dict(name=MODEL, e=e, k=k, i=i, s=s, d_in=d, d_out=d, shared=shared, act=cfg.hidden_act,
                         w13=randn(e, 2 * i, d, scale=d ** -0.5), w2=randn(e, d, i, scale=i ** -0.5))

    def args(self, n, r, ids, wts, gen):
        spec, shared = self.spec, self.spec["shared"][r]
        x = torch.randn(n, spec["d_in"], generator=gen, device=DEVICE).bfloat16()
        return dict(x=x, topk_ids=ids, topk_weights=wts, w13=spec["w13"], w2=spec["w2"], shared_w2=shared["w2"],
                    shared_w13=shared["w13"], act=spec["act"])

    def extra_bytes(self, n):
        """Kernel A also reads the shared expert's gate/up rows and stores its activated input (fp32)."""
        return {"_expert_up_kernel": 2 * self.spec["s"] * self.spec["d_in"] * 2 + n * self.spec["s"] * 4}

    def keys(self, n) -> dict:
        """A's ROWS_TUNED key and B''s SPLIT_TUNED key at batch n (B': the k routed slots + the shared one)."""
        spec = self.spec
        return {"A": ("up", n * spec["k"], spec["i"], spec["d_in"]),
                "B": (n * (spec["k"] + 1), spec["d_out"], spec["i"], False)}

    def today(self, n) -> dict:
        kk = self.keys(n)
        kernel, pairs, rows, width = kk["A"]
        return {"A": moe_launch.rows_config(pairs, rows, pairs, kernel, width), "B": moe_launch.split_config(*kk["B"]),
                "F": 0}

    def arms(self, n, best):
        base = {key: list(v) if isinstance(v, tuple) else v for key, v in self.today(n).items()}
        earlier = [b["best"]["launches"] for b in best]  # what earlier batches picked: tried first here
        first = [(f"{key} (batch {b['batch']})", dict(base, **{key: w[key]}, **({"B": w["B"]} if key == "F" else {})))
                 for b, w in zip(best, earlier) for key in ("A", "F") if w[key] != base[key]]
        out = [("A", dict(base, A=list(c))) for c in moe_launch.FULL_ROWS_CANDIDATES if list(c) != base["A"]]
        out += [("F", dict(base, F=1))]
        out += [("F", dict(base, F=1, B=list(c))) for c in moe_launch.FLAG_SPLIT_CANDIDATES if list(c) != base["B"]]
        out += [("B", dict(base, B=list(c))) for c in moe_launch.SPLIT_CANDIDATES if list(c) != base["B"]]
        return first + [arm for arm in out if all(arm[1] != f[1] for f in first)]

    def run(self, n, kw, launches):
        return moe_decode.fused_moe_triton(**kw, use_pdl=True, shared_l2_prefetch=True, down_l2_prefetch=True,
                                           up_launch=launches["A"], split=moe_launch.SplitConfig(*launches["B"]),
                                           flag_deps=bool(launches["F"]))

    def entries(self, n, launches) -> list[str]:
        lines = super().entries(n, launches)
        if launches["F"]:
            lines.append(f"{P6}.flag_deps=true (default off until the whole-engine A/B)")
        return lines


def variant(name: str, launches: dict, today: dict) -> str | None:
    """`--variant` string (P6 options) for what `launches` changes from today, None if nothing."""
    opts = []
    if list(launches["A"]) != list(today["A"]):
        opts.append(f"{P6}.up_launch={'x'.join(map(str, launches['A']))}")
    if list(launches["B"]) != list(today["B"]):
        opts.append(f"{P6}.down_split={'x'.join(str(int(v)) for v in launches['B'])}")
    if launches["F"]:
        opts.append(f"{P6}.flag_deps=true")
    return f"{name}:{','.join(opts)}" if opts else None


def ladder_variants(out_dir: str) -> list[str]:
    """From out_dir's moe11.json: per batch, the fastest arm's A launch alone (a), and flag_deps on with today's B' and
    with the fastest flag arm's B' (b), and the batch's fastest arm as a whole; deduplicated."""
    with open(os.path.join(out_dir, "moe11.json")) as f:
        data = json.load(f)
    out = []
    for b in data["best"]:
        n, win = b["batch"], b["best"]["launches"]
        today = b["today"]["launches"]
        flags = [r for r in data["rows"] if r["batch"] == n and r["launches"]["F"] and r["rel_err"] < 1e-2]
        fastest_flag = min(flags, key=lambda r: r["op_us"])["launches"] if flags else dict(today, F=1)
        for name, launches in ((f"a{n}", dict(today, A=win["A"])), ("flags", dict(today, F=1)),
                               (f"flags{n}", fastest_flag), (f"best{n}", win)):
            v = variant(name, launches, today)
            if v and v.partition(":")[2] not in [o.partition(":")[2] for o in out]:
                out.append(v)
    return out


def main(out_dir: str, budget_s: float, batches) -> None:
    if any(moe_launch.kernel_designs(n, False) != ("rows", "split") for n in batches):
        print("note: kernel_designs is not (rows, split) at every swept batch; the engine runs those designs")
    shape = FullWidth(torch.Generator(device=DEVICE).manual_seed(0))
    sweep(shape, out_dir, budget_s, batches)
    print("\nbench ladder variants (whole engine, --batch 1,8):")
    for v in ladder_variants(out_dir):
        print(f"  --variant '{v}'")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."),
         float(sys.argv[2]) if len(sys.argv) > 2 else 75.0,
         tuple(int(b) for b in sys.argv[3].split(",")) if len(sys.argv) > 3 else FullWidth.batches)
