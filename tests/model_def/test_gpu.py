"""CUDA paths against the fp32 CPU reference (marked `gpu`; skipped without CUDA).

Whole model: a k3-tiny-like config with K = V = 128 KDA heads (the shapes fla's kernels take), run in
bf16 on CUDA and in fp32 on CPU on the same (bf16-rounded) weights; prefill and ragged batched decode.
Ops: torch.ops.k3.* on CUDA tensors against the same op on CPU in fp32, fed the same bf16-rounded
inputs. Whichever CUDA kernel is registered for an op runs (`ops/cuda_backend.py`: fla's KDA kernels
when fla imports, grouped-GEMM experts, SDPA prefill; else the pure-torch reference on the GPU); the
tests print which (run with `-s`) and record it as a junit property.

Tolerances. Outputs are compared by relative Frobenius error ‖a − b‖ / ‖b‖.
* ops: < 2e-2 (bf16 keeps 8 mantissa bits; the reference on the same inputs lands near 2e-3).
* whole model in bf16: < max(2e-2, 2 x floor), where floor is the error of the pure-torch reference
  itself run in bf16 on CPU (same weights). Rounding compounds over layers: on this 5-layer config the
  floor is 1.6-1.9e-2, so a bare 2e-2 would flag rounding, not bugs; a kernel bug gives O(1) errors.
  The whole-model config routes every token to all experts: top-k selection is discrete, and bf16
  noise flips near-tied choices (whole experts swap for that token: 6-12% logit error from the
  reference alone at top-2). Selection itself is tested exactly on CPU (test_moe.py, test_hf_parity.py).
* whole model in fp32 on CUDA: < 1e-2 (fla's Triton dots run fp32 inputs as TF32, ~1e-3 per dot).
"""
import pytest
import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.config import get_preset
from k3compile.model_def.init import init_random
from k3compile.model_def.loader import build_model
from k3compile.model_def.ops import library  # noqa: F401  (registers torch.ops.k3.* and the CUDA overrides)
from k3compile.model_def.ops.kda_math import kda_gate

from .helpers import assert_fla_in_use

try:
    from k3compile.model_def.ops.cuda_backend import BACKENDS
except ImportError:  # no CUDA backend module: the reference runs on CUDA
    BACKENDS = {}

pytestmark = pytest.mark.gpu
REL_TOL = 2e-2
FP32_TOL = 1e-2
CUDA = "cuda"


def rel_err(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm()).item()


def backend(op: str) -> str:
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"k3::{op}", "CUDA"):
        return "CUDA override"
    return "reference"


def report(record_property, what, err, ops=()):
    used = {op: backend(op) for op in ops}
    record_property(what, err)
    record_property("backends", {"dispatch": used, "cuda_backend.BACKENDS": dict(BACKENDS)})
    figures = " / ".join(f"{e:.2e}" for e in (err if isinstance(err, tuple) else (err,)))
    print(f"\n[gpu] {what}: {figures}  dispatch {used}  BACKENDS {BACKENDS}")


def gpu_config(family: str):
    """Small but kernel-friendly: KDA K = V = 128; 5 layers (MLA at 0-based 3 and 4); all experts routed."""
    common = dict(hidden_size=256, num_hidden_layers=5, layer_types=(), kda_num_heads=2, kda_head_dim=128,
                  num_attention_heads=2, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  intermediate_size=256, num_experts=8, num_experts_per_token=8, moe_intermediate_size=64)
    if family == "k3":  # lower-bounded gate (fla safe_gate path), AttnRes with a boundary every 2 layers
        return get_preset("k3-tiny").replace(name="k3-gpu", q_lora_rank=64, latent_size=128,
                                             attn_res_block_size=2, **common)
    return get_preset("kimi-linear-tiny").replace(name="kimi-linear-gpu", **common)  # softplus gate


def same_weights(cfg, src, dtype, device):
    model = build_model(cfg, dtype=dtype, device=device)
    model.load_state_dict(src.state_dict())  # buffers (router bias) stay fp32
    return model


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def models(request):
    """(family, fp32 CPU reference, bf16 CPU reference (noise floor), bf16 CUDA model), same weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = gpu_config(request.param)
    init = build_model(cfg)
    init_random(init, seed=7)
    gpu = same_weights(cfg, init, torch.bfloat16, CUDA)
    ref = same_weights(cfg, gpu, torch.float32, "cpu")  # fp32 on the bf16-rounded values
    floor = same_weights(cfg, gpu, torch.bfloat16, "cpu")
    return request.param, ref, floor, gpu


class DeviceSessions:
    """Fixed slot and a contiguous page run per request, on a given device."""

    def __init__(self, model, n, max_len, device, page_size=16):
        self.model, self.device, self.page_size = model, device, page_size
        self.per = (max_len + page_size - 1) // page_size
        self.cache = CacheTensors.allocate(model.cache_spec(), n + 1, n * self.per + 1, page_size, device=device)
        self.lens = [0] * n

    def step(self, mode, reqs, tokens, logits="last"):
        rows = [[1 + r * self.per + j for j in range(self.per)] for r in reqs]
        batch = ForwardBatch.build(mode, tokens, [self.lens[r] for r in reqs], rows, [r + 1 for r in reqs],
                                   self.page_size, device=self.device, logits=logits)
        with torch.no_grad():
            out = self.model.step(batch, self.cache)
        for r, t in zip(reqs, tokens):
            self.lens[r] += len(t)
        return out.float().cpu()


def token_lists(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def session_logits(model, device, prompts, follow):
    """Ragged prefill of all requests in one batch, then batched decode steps; logits of every step."""
    s = DeviceSessions(model, len(prompts), 160, device)
    reqs = list(range(len(prompts)))
    out = [s.step("prefill", reqs, prompts, logits="all")]
    for t in range(len(follow[0])):
        out.append(s.step("decode", reqs, [[f[t]] for f in follow]))
    return out


# ----------------------------------------------------------------------------------- whole model

def test_prefill_logits_match_cpu(models, record_property):
    family, ref, floor_model, gpu = models
    ids = torch.tensor(token_lists([100, 100], seed=1))  # one full 64-token KDA chunk and a tail
    expected = ref(ids)
    got = gpu(ids.to(CUDA))
    assert got.shape == expected.shape
    err, floor = rel_err(got, expected), rel_err(floor_model(ids), expected)
    report(record_property, f"{family} bf16 prefill logits: cuda / cpu-bf16 floor", (err, floor),
           ("kda_prefill", "short_conv_prefill", "mla_prefill", "moe_experts"))
    assert err < max(REL_TOL, 2 * floor)


def test_ragged_prefill_then_batched_decode_match_cpu(models, record_property):
    family, ref, floor_model, gpu = models
    prompts, follow = token_lists([5, 70, 130], seed=2), token_lists([6, 6, 6], seed=3)
    expected = session_logits(ref, "cpu", prompts, follow)
    got = session_logits(gpu, CUDA, prompts, follow)
    floors = session_logits(floor_model, "cpu", prompts, follow)
    errs = [rel_err(g, e) for g, e in zip(got, expected)]
    floor = max(rel_err(f, e) for f, e in zip(floors, expected))
    report(record_property, f"{family} bf16 prefill+6 decode steps, worst step: cuda / cpu-bf16 floor",
           (max(errs), floor), ("kda_prefill", "kda_decode", "short_conv_decode", "mla_decode", "moe_experts"))
    assert max(errs) < max(REL_TOL, 2 * floor), errs


def test_fp32_on_cuda_matches_cpu(models, record_property):
    family, ref, _, gpu = models
    gpu32 = same_weights(ref.config, ref, torch.float32, CUDA)
    ids = torch.tensor(token_lists([100, 37], seed=4)[:1] * 2)
    prompts, follow = token_lists([70, 9], seed=5), token_lists([4, 4], seed=6)
    errs = [rel_err(gpu32(ids.to(CUDA)), ref(ids))]
    errs += [rel_err(g, e) for g, e in zip(session_logits(gpu32, CUDA, prompts, follow),
                                            session_logits(ref, "cpu", prompts, follow))]
    report(record_property, f"{family} fp32 prefill + decode, worst", max(errs), ("kda_prefill", "kda_decode"))
    assert max(errs) < FP32_TOL, errs


# ---------------------------------------------------------------------------------------- ops

H, K, V = 4, 128, 128


def kda_inputs(n, gate, seed, device):
    """Raw q, k, v (bf16), log-decay g and beta (fp32), as the KDA mixer hands them to the ops."""
    g_ = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, d, generator=g_).bfloat16() for d in (K, K, V))
    f = torch.randn(n, H * K, generator=g_)
    dt_bias = torch.randn(H * K, generator=g_) * 0.5
    if gate == "lower_bound":
        g = kda_gate(f, torch.zeros(H), dt_bias, K, -5.0)
    else:
        g = kda_gate(f, torch.empty(H).uniform_(1, 16, generator=g_).log(), dt_bias, K, None)
    beta = torch.rand(n, H, generator=g_)
    return [t.to(device) for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_kda_prefill_op_matches_cpu(gate, record_property):
    """Ragged varlen batch: fresh requests (stale slot contents ignored) and continued ones (state read)."""
    assert_fla_in_use()
    lens, prefixes, slots = [1, 64, 150, 17], [0, 0, 40, 9], [3, 1, 0, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor([p + n for p, n in zip(prefixes, lens)], dtype=torch.int32)
    pool = torch.randn(6, 2, H, K, V, generator=torch.Generator().manual_seed(4)) * 0.1
    cpu_pool, gpu_pool = pool.clone(), pool.to(CUDA)
    cpu_in = [t.float() for t in kda_inputs(sum(lens), gate, 5, "cpu")]
    gpu_in = kda_inputs(sum(lens), gate, 5, CUDA)
    s = torch.tensor(slots)
    out_cpu = torch.ops.k3.kda_prefill(*cpu_in, cpu_pool, 1, s, cu, seq)
    out_gpu = torch.ops.k3.kda_prefill(*gpu_in, gpu_pool, 1, s.to(CUDA), cu.to(CUDA), seq.to(CUDA))
    assert out_gpu.dtype == torch.bfloat16 and gpu_pool.dtype == torch.float32
    err_o, err_s = rel_err(out_gpu, out_cpu), rel_err(gpu_pool[s, 1], cpu_pool[s, 1])
    report(record_property, f"kda_prefill[{gate}] out / final state", (err_o, err_s), ("kda_prefill",))
    assert err_o < REL_TOL and err_s < REL_TOL
    assert torch.equal(gpu_pool[:, 0].cpu(), pool[:, 0]) and torch.equal(gpu_pool[[2, 4]].cpu(), pool[[2, 4]])


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_kda_decode_op_matches_cpu(gate, record_property):
    assert_fla_in_use()
    slots = torch.tensor([4, 0, 2, 7, 5])
    pool = torch.randn(8, 2, H, K, V, generator=torch.Generator().manual_seed(6)) * 0.1
    cpu_pool, gpu_pool = pool.clone(), pool.to(CUDA)
    errs = []
    for step in range(8):
        cpu_in = [t.float() for t in kda_inputs(len(slots), gate, 10 + step, "cpu")]
        gpu_in = kda_inputs(len(slots), gate, 10 + step, CUDA)
        out_cpu = torch.ops.k3.kda_decode(*cpu_in, cpu_pool, 0, slots)
        out_gpu = torch.ops.k3.kda_decode(*gpu_in, gpu_pool, 0, slots.to(CUDA))
        errs.append((rel_err(out_gpu, out_cpu), rel_err(gpu_pool[slots, 0], cpu_pool[slots, 0])))
    worst = tuple(max(e[i] for e in errs) for i in range(2))
    report(record_property, f"kda_decode[{gate}] out / state, worst of 8 steps", worst, ("kda_decode",))
    assert max(worst) < REL_TOL, errs
    untouched = [1, 3, 6]
    assert torch.equal(gpu_pool[untouched].cpu(), pool[untouched]) and torch.equal(gpu_pool[:, 1].cpu(), pool[:, 1])


def test_short_conv_ops_match_cpu(record_property):
    g_ = torch.Generator().manual_seed(7)
    W, channels = 4, H * K
    weight = torch.randn(channels, W, generator=g_).bfloat16()
    pool = torch.randn(4, 2, 3 * channels, W - 1, generator=g_).bfloat16()
    cpu_pool, gpu_pool = pool.float(), pool.to(CUDA)
    off = channels  # the k stream's channels
    slots = torch.tensor([2, 0])
    cu, seq = torch.tensor([0, 3, 83], dtype=torch.int32), torch.tensor([3, 92], dtype=torch.int32)
    x = torch.randn(83, channels, generator=g_).bfloat16()
    y_cpu = torch.ops.k3.short_conv_prefill(x.float(), weight.float(), cpu_pool, 1, off, slots, cu, seq)
    y_gpu = torch.ops.k3.short_conv_prefill(x.to(CUDA), weight.to(CUDA), gpu_pool, 1, off, slots.to(CUDA),
                                            cu.to(CUDA), seq.to(CUDA))
    errs = [rel_err(y_gpu, y_cpu), rel_err(gpu_pool, cpu_pool)]
    for _ in range(4):
        xd = torch.randn(2, channels, generator=g_).bfloat16()
        y_cpu = torch.ops.k3.short_conv_decode(xd.float(), weight.float(), cpu_pool, 1, off, slots)
        y_gpu = torch.ops.k3.short_conv_decode(xd.to(CUDA), weight.to(CUDA), gpu_pool, 1, off, slots.to(CUDA))
        errs += [rel_err(y_gpu, y_cpu), rel_err(gpu_pool, cpu_pool)]
    report(record_property, "short_conv prefill + 4 decode steps, worst", max(errs),
           ("short_conv_prefill", "short_conv_decode"))
    assert max(errs) < REL_TOL, errs


def test_moe_experts_op_matches_cpu(record_property):
    g_ = torch.Generator().manual_seed(8)
    n, d, e, inter, k = 300, 128, 16, 64, 4
    x = torch.randn(n, d, generator=g_).bfloat16()
    w13 = (torch.randn(e, 2 * inter, d, generator=g_) * d ** -0.5).bfloat16()
    w2 = (torch.randn(e, d, inter, generator=g_) * inter ** -0.5).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g_)[:k] for _ in range(n)])
    ids[:40] = torch.arange(k)  # a crowded expert next to rarely hit ones
    w = torch.rand(n, k, generator=g_)
    errs = []
    for act in ("silu", "situ"):
        ref = torch.ops.k3.moe_experts(x.float(), ids, w, w13.float(), w2.float(), act, 4.0, 25.0)
        got = torch.ops.k3.moe_experts(x.to(CUDA), ids.to(CUDA), w.to(CUDA), w13.to(CUDA), w2.to(CUDA), act, 4.0, 25.0)
        errs.append(rel_err(got, ref))
    report(record_property, "moe_experts silu / situ", tuple(errs), ("moe_experts",))
    assert max(errs) < REL_TOL, errs


def test_mla_prefill_op_matches_cpu(record_property):
    g_ = torch.Generator().manual_seed(9)
    h, nope, rope, v_dim, r, page = 4, 32, 16, 32, 64, 16
    kv = torch.randn(12, 1, page, r + rope, generator=g_).bfloat16()
    kv_b = (torch.randn(h * (nope + v_dim), r, generator=g_) * r ** -0.5).bfloat16()
    lens, prefixes = [20, 1, 45], [0, 30, 7]
    page_table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    cu = torch.tensor([0, 20, 21, 66], dtype=torch.int32)
    seq = torch.tensor([p + n for p, n in zip(prefixes, lens)], dtype=torch.int32)
    q = torch.randn(66, h, nope + rope, generator=g_).bfloat16()
    args = (0, None, page_table, cu, seq, (nope + rope) ** -0.5, r, nope)
    ref = torch.ops.k3.mla_prefill(q.float(), kv.float(), 0, kv_b.float(), *args[2:])
    got = torch.ops.k3.mla_prefill(q.to(CUDA), kv.to(CUDA), 0, kv_b.to(CUDA),
                                   *(a.to(CUDA) if torch.is_tensor(a) else a for a in args[2:]))
    err = rel_err(got, ref)
    report(record_property, "mla_prefill", err, ("mla_prefill",))
    assert err < REL_TOL


def test_batched_prefill_ops_match_cpu(record_property):
    """Many requests sharing chunk lengths (the batched paths: one SDPA call per chunk length, one packed short
    conv, one fla call), contexts of different lengths in a group, NaN in the padding page nobody owns."""
    g_ = torch.Generator().manual_seed(11)
    h, nope, rope, v_dim, r, page = 4, 32, 16, 32, 64, 16
    lens = [16, 16, 1, 16, 1, 1, 16, 16]
    prefixes = [0, 37, 5, 0, 60, 0, 12, 3]
    seq = [p + n for p, n in zip(prefixes, lens)]
    per = max(-(-s // page) for s in seq)
    table = torch.tensor([[1 + i * per + j for j in range(per)] for i in range(len(lens))], dtype=torch.int32)
    kv = torch.randn(1 + len(lens) * per, 1, page, r + rope, generator=g_).bfloat16()
    kv[0] = float("nan")
    kv_b = (torch.randn(h * (nope + v_dim), r, generator=g_) * r ** -0.5).bfloat16()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    q = torch.randn(sum(lens), h, nope + rope, generator=g_).bfloat16()
    scale = (nope + rope) ** -0.5
    ref = torch.ops.k3.mla_prefill(q.float(), kv.float(), 0, kv_b.float(), table, cu, seq_t, scale, r, nope)
    got = torch.ops.k3.mla_prefill(q.to(CUDA), kv.to(CUDA), 0, kv_b.to(CUDA), table.to(CUDA), cu.to(CUDA),
                                   seq_t.to(CUDA), scale, r, nope)
    errs = [rel_err(got, ref)]
    W, channels = 4, 64
    weight = torch.randn(channels, W, generator=g_).bfloat16()
    pool = torch.randn(len(lens), 1, channels, W - 1, generator=g_).bfloat16()
    cpu_pool, gpu_pool = pool.float(), pool.to(CUDA)
    x = torch.randn(sum(lens), channels, generator=g_).bfloat16()
    slots = torch.randperm(len(lens), generator=g_)
    y_cpu = torch.ops.k3.short_conv_prefill(x.float(), weight.float(), cpu_pool, 0, 0, slots, cu, seq_t)
    y_gpu = torch.ops.k3.short_conv_prefill(x.to(CUDA), weight.to(CUDA), gpu_pool, 0, 0, slots.to(CUDA),
                                            cu.to(CUDA), seq_t.to(CUDA))
    errs += [rel_err(y_gpu, y_cpu), rel_err(gpu_pool, cpu_pool)]
    report(record_property, "batched mla_prefill / short conv out / windows", tuple(errs),
           ("mla_prefill", "short_conv_prefill"))
    assert torch.isfinite(got.float()).all() and max(errs) < REL_TOL, errs
