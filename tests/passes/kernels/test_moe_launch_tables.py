"""The fused MoE decode op's per-shape launch tables (ROWS_TUNED: kernel A's "rows" launch and B's "rows" design;
SPLIT_TUNED: B'; LATENT_TUNED: kernel C): a table entry is the launch the op makes, launches from the tables match
the CPU reference under the interpreter, and on CUDA every candidate tools/bench_moe10mini.py may pick at the
k3-mini-6b latent MoE shape matches the reference."""
import pytest
import torch

from k3compile.model_def.config import get_preset
from k3compile.passes.kernels import moe_decode, moe_launch
from k3compile.passes.kernels.moe_decode import fused_moe_reference, random_routing
from k3compile.passes.kernels.moe_launch import LatentConfig, SplitConfig

from .interpreted import run_interpreted

needs_triton = pytest.mark.skipif(moe_decode.triton is None, reason="needs triton")


def _latent_problem(n, e=6, k=3, lat=64, i=32, d=80, s=48, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    ids, wts = random_routing(n, e, k, device, seed)
    return dict(x=randn(n, lat), topk_ids=ids, topk_weights=wts, w13=randn(e, 2 * i, lat, scale=lat ** -0.5),
                w2=randn(e, lat, i, scale=i ** -0.5), shared_in=randn(n, s), shared_up=randn(n, s),
                shared_w2=randn(d, s, scale=s ** -0.5), act="situ", beta=4.0, linear_beta=25.0,
                latent_up_w=randn(d, lat, scale=lat ** -0.5), latent_norm_w=(1 + 0.1 * randn(lat)).to(dtype),
                latent_eps=1e-5)


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **constexprs)` records (grid, constexprs), runs nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((tuple(grid), kw))


def _launches(monkeypatch, p, designs=("rows", "split")):
    kernels = {name: _Recorder() for name in ("_expert_up_rows_kernel", "_expert_down_split_kernel",
                                              "_latent_out_kernel")}
    for name, rec in kernels.items():
        monkeypatch.setattr(moe_decode, name, rec)
    moe_decode.fused_moe_triton(**p, designs=designs)
    assert all(len(rec.calls) == 1 for rec in kernels.values())
    return [rec.calls[0] for rec in kernels.values()]


@needs_triton
def test_table_entries_are_the_launches_the_op_makes(monkeypatch):
    n, k, lat, i, d, s = 2, 3, 64, 32, 80, 48
    p = _latent_problem(n, k=k, lat=lat, i=i, d=d, s=s)
    # no entry: the rules (what the op launched before the tables existed)
    (grid_a, a), (grid_b, b), (grid_c, c) = _launches(monkeypatch, p)
    bn, bk, warps = moe_launch.rows_config(n * k, i, n * k)
    assert (grid_a, a["BLOCK_N"], a["BLOCK_K"], a["num_warps"]) == ((n * k, -(-i // bn)), bn, bk, warps)
    rule_b = SplitConfig(*moe_launch.gemv_config("split", n * k, lat, i, False))
    assert (b["BLOCK_N"], b["BLOCK_K"], b["num_warps"], b["KSPLIT"], b["PREFETCH"]) == rule_b
    rule_c = moe_launch.gemv_config("latent", n, d, lat, False)
    assert (grid_c, c["BLOCK_N"], c["num_warps"]) == ((n, -(-d // rule_c[0])), rule_c[0], rule_c[2])
    assert (c["BLOCK_K"], c["BLOCK_KS"]) == (moe_launch.shared_block_k(rule_c[0], lat),
                                             moe_launch.shared_block_k(rule_c[0], s))
    # entries for this shape: exactly those launches (grids follow BLOCK_N)
    monkeypatch.setitem(moe_launch.ROWS_TUNED, ("up", n * k, i, lat), (4, 64, 8))
    monkeypatch.setitem(moe_launch.SPLIT_TUNED, (n * k, lat, i, False), SplitConfig(16, 32, 2, 2, True))
    monkeypatch.setitem(moe_launch.LATENT_TUNED, (n, d, lat, s), LatentConfig(32, 64, 32, 8))
    (grid_a, a), (grid_b, b), (grid_c, c) = _launches(monkeypatch, p)
    assert (grid_a, a["BLOCK_N"], a["BLOCK_K"], a["num_warps"]) == ((n * k, i // 4), 4, 64, 8)
    assert (grid_b, b["BLOCK_N"], b["BLOCK_K"], b["num_warps"], b["KSPLIT"], b["PREFETCH"]) == (
        (n * -(-lat // 16), k * 2), 16, 32, 2, 2, True)
    assert (grid_c, c["BLOCK_N"], c["BLOCK_K"], c["BLOCK_KS"], c["num_warps"]) == ((n, -(-d // 32)), 32, 64, 32, 8)
    # the op's explicit overrides still win over the tables (tests, tile sweeps)
    kernels = {name: _Recorder() for name in ("_expert_up_rows_kernel", "_expert_down_split_kernel",
                                              "_latent_out_kernel")}
    for name, rec in kernels.items():
        monkeypatch.setattr(moe_decode, name, rec)
    moe_decode.fused_moe_triton(**p, designs=("rows", "split"), block_n=8, block_k=32, num_warps=2)
    for rec in kernels.values():
        _, kw = rec.calls[0]
        assert (kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"]) == (8, 32, 2)


def test_k3_mini_launches_from_the_tables_and_bad_entries_raise(monkeypatch):
    """k3-mini-6b batch 1 keeps the rules' launches (its sweep winner was within noise), batch 8 takes the session-10
    table entries; the 48B layer's kernel A takes session 11's entries at batch 1 (8 warps) and 8 (16 x 256 tiles). A bad entry is refused with a message naming the field."""
    if moe_decode.triton is None:
        pytest.skip("needs triton")
    assert moe_launch.rows_config(8, 512, 8, "up", 1024) == (8, 256, 4)
    assert moe_launch.rows_config(64, 512, 64, "up", 1024) == (32, 128, 4)
    assert moe_launch.split_config(8, 1024, 512, False) == SplitConfig(8, 512, 4)
    assert moe_launch.latent_config(1, 2048, 1024, 1024) == LatentConfig(4, 1024, 1024, 4)
    assert moe_launch.latent_config(8, 2048, 1024, 1024) == LatentConfig(32, 256, 256, 4)
    assert moe_launch.rows_config(8, 1024, 8, "up", 2304) == (16, 256, 8)
    assert moe_launch.rows_config(64, 1024, 64, "up", 2304) == (16, 256, 4)
    assert sorted(key for key in moe_launch.ROWS_TUNED if key[3] == 2304) == [("up", 8, 1024, 2304),
                                                                              ("up", 64, 1024, 2304)]
    assert moe_launch.latent_config(1, 2048, 1024, 1024, block_n=16) == LatentConfig(16, 512, 512, 4)
    monkeypatch.setitem(moe_launch.LATENT_TUNED, (1, 2048, 1024, 1024), LatentConfig(8, 100, 64, 4))
    with pytest.raises(ValueError, match="latent block_k must be a power of two"):
        moe_launch.latent_config(1, 2048, 1024, 1024)
    monkeypatch.setitem(moe_launch.ROWS_TUNED, ("up", 8, 512, 1024), (8, 256, 3))
    with pytest.raises(ValueError, match="rows num_warps must be a power of two"):
        moe_launch.rows_config(8, 512, 8, "up", 1024)


@needs_triton
def test_up_launch_and_flag_deps_reach_the_launches(monkeypatch):
    """up_launch is kernel A's launch (either design; the explicit block_n / num_warps still win); flag_deps adds the
    flag constexprs to A and B' (shared slot counted when A has it) only when B' is the down-projection; the chunk
    widths follow B''s K cut (_chunk); bad launches and counters too narrow are refused."""
    p = _latent_problem(2, lat=64, i=32, d=64, s=48)
    full = {key: v for key, v in p.items() if not key.startswith(("latent", "shared_in", "shared_up"))}
    full["shared_w13"] = torch.randn(2 * 48, 64)
    kernels = {name: _Recorder() for name in ("_expert_up_rows_kernel", "_expert_up_kernel",
                                              "_expert_down_split_kernel", "_expert_down_kernel")}
    for name, rec in kernels.items():
        monkeypatch.setattr(moe_decode, name, rec)
    moe_decode.fused_moe_triton(**full, designs=("rows", "split"), up_launch=(4, 64, 8))
    grid, a = kernels["_expert_up_rows_kernel"].calls[-1]
    assert (grid, a["BLOCK_N"], a["BLOCK_K"], a["num_warps"]) == ((2 * 4, 48 // 4), 4, 64, 8) and "FLAGS" not in a
    moe_decode.fused_moe_triton(**full, designs=("tiles", "split"), up_launch=(4, 64, 8), block_n=8)
    assert kernels["_expert_up_kernel"].calls[-1][1]["BLOCK_N"] == 8
    split = SplitConfig(16, 32, 4, 3)
    moe_decode.fused_moe_triton(**full, designs=("rows", "split"), split=split, flag_deps=True)
    (_, a), (_, b) = kernels["_expert_up_rows_kernel"].calls[-1], kernels["_expert_down_split_kernel"].calls[-1]
    assert a["FLAGS"] and a["KSPLIT"] == 3 and a["FLAG_STRIDE"] == moe_decode.FLAG_STRIDE
    assert b["FLAGS"] and b["FLAG_SHARED"] and b["SPIN"] and b["KSPLIT"] == 3
    moe_decode.fused_moe_triton(**full, designs=("rows", "tiles"), flag_deps=True)  # no B': nothing to wait per chunk
    assert "FLAGS" not in kernels["_expert_up_rows_kernel"].calls[-1][1]
    # B''s chunks: I = 32 in 3 chunks of one 32-wide tile (two empty), the shared Is = 48 in 3 chunks of 32 (BLOCK_KS)
    assert moe_launch.flag_chunks(32, 48, 64, split, 32) == (32, 32)
    assert moe_launch.flag_chunks(1024, 1024, 2304, SplitConfig(64, 128, 4, 2), 128) == (512, 512)
    assert moe_launch.flag_chunks(1024, 0, 2304, SplitConfig(64, 128, 4), 128) == (1024, 1)
    with pytest.raises(ValueError, match="flag_deps counts up to"):
        moe_launch.flag_chunks(1 << 16, 0, 64, SplitConfig(64, 128, 4), 128)
    with pytest.raises(ValueError, match="up block_k must be a power of two"):
        moe_decode.fused_moe_triton(**full, up_launch=(4, 48, 4))


@needs_triton
def test_launch_tables_under_interpreter_match_reference():
    run_interpreted("interpret_moe_launch_tables.py", timeout=600)


# ------------------------------------------------------------------------------------- CUDA

def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_every_k3_mini_launch_candidate_matches_reference(n):
    """Each launch tools/bench_moe10mini.py may make the default at the k3-mini-6b latent MoE shape (bf16, PDL on),
    put in through its table (A: ROWS_TUNED, C: LATENT_TUNED) or the op's split argument (B'), matches the fp32
    reference."""
    cfg = get_preset("k3-mini-6b")
    k, i, lat, d = cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.latent_size, cfg.hidden_size
    s = i * cfg.num_shared_experts
    p = _latent_problem(n, e=cfg.num_experts, k=k, lat=lat, i=i, d=d, s=s, device="cuda", dtype=torch.bfloat16,
                        seed=n)
    ref = fused_moe_reference(**{key: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                                 for key, v in p.items()})
    arms = [("A", c) for c in moe_launch.ROWS_CANDIDATES] + [("C", c) for c in moe_launch.LATENT_CANDIDATES]
    arms += [("B", c) for c in moe_launch.LATENT_SPLIT_CANDIDATES]
    for kernel, launch in arms:
        table, key = {"A": (moe_launch.ROWS_TUNED, ("up", n * k, i, lat)),
                      "C": (moe_launch.LATENT_TUNED, (n, d, lat, s)), "B": (None, None)}[kernel]
        if table is not None:
            table[key] = launch
        try:
            got = moe_decode.fused_moe_triton(**p, use_pdl=True, designs=("rows", "split"),
                                              split=launch if kernel == "B" else None)
        finally:
            if table is not None:
                table.pop(key)
        assert got.shape == (n, d) and _rel(got, ref) < 1e-2, (kernel, launch, _rel(got, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8])
def test_cuda_every_48b_kernel_a_launch_candidate_matches_reference(n):
    """Each kernel A launch tools/bench_moe11.py may make the default at the Kimi-Linear-48B shape
    (FULL_ROWS_CANDIDATES, through the op's up_launch argument, as P6's up_launch option passes it), with the shared
    slot in A as P6 emits the op (L2 options on, PDL on), bf16: matches the fp32 reference."""
    cfg = get_preset("kimi-linear-48b")
    e, k, i, d = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(900 + n)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()
    ids, wts = random_routing(n, e, k, "cuda", n)
    p = dict(x=randn(n, d), topk_ids=ids, topk_weights=wts, w13=randn(e, 2 * i, d, scale=d ** -0.5),
             w2=randn(e, d, i, scale=i ** -0.5), shared_w2=randn(d, i, scale=i ** -0.5),
             shared_w13=randn(2 * i, d, scale=d ** -0.5), act="silu")
    ref = fused_moe_reference(**{key: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                                 for key, v in p.items()})
    for launch in moe_launch.FULL_ROWS_CANDIDATES:
        got = moe_decode.fused_moe_triton(**p, use_pdl=True, shared_l2_prefetch=True, down_l2_prefetch=True,
                                          up_launch=launch)
        assert got.shape == (n, d) and _rel(got, ref) < 1e-2, (launch, _rel(got, ref))
