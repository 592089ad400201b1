"""P1-P5 on CUDA (bf16): verification passes with the GPU's GEMM algorithms and kernels (fla KDA,
Triton fused_route and fused_kda_decode), the post-pass graph matches the eager model, and it launches fewer kernels."""
import pytest
import torch

import k3compile
from k3compile.capture import capture_step
from k3compile.passes.manager import PassManager, snapshot
from k3compile.passes.verify import randomized_inputs, step_inputs

from .helpers import BF16_TOL, assert_same_step, eager_step, layer_counts, run_graph

pytestmark = pytest.mark.gpu


def _kernels_per_step(gm, inputs) -> int:
    run_graph(gm, inputs)  # warm-up: Triton compiles, cuBLAS picks algorithms
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_graph(gm, inputs)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.fixture(scope="module")
def model():
    return k3compile.load_model("k3-tiny", dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_pipeline_on_cuda_bf16(model, mode):
    m = model
    gm = capture_step(m, mode)
    before = snapshot(gm)
    report = PassManager(verify=True).run(gm, step_inputs(m, mode))
    n = layer_counts(m.config)
    assert report.matches()["p01_gemm_merge"] == n["kda"] + n["mla"] + n["moe"] + n["dense"]
    assert report.matches()["p04_fused_routing"] == n["moe"]
    assert report.matches()["p05_fused_kda_decode"] == (n["kda"] if mode == "decode" else 0)
    assert report.matches()["p07_attn_res_norm"] == 2 * n["layers"] + 1
    assert report.matches()["p07_norm_route"] == (n["moe"] if mode == "decode" else 0)  # bf16: absorbed routers
    # absorb_q=fold (+ W_UK), gate_out (+ K3's output gate), q_norm_gemv (+1 where P8 chose its GEMV for q_b)
    gated = n["mla"] if m.config.mla_output_gate else 0
    p15 = report.matches()["p15_mla_decode"]
    assert (4 * n["mla"] + gated <= p15 <= 5 * n["mla"] + gated) if mode == "decode" else p15 == 0
    print(report.render())
    x = randomized_inputs(step_inputs(m, mode, seed=5), 5)
    assert_same_step(run_graph(gm, x), eager_step(m, mode, x), BF16_TOL, "post-pass graph vs eager on CUDA")
    k_before, k_after = _kernels_per_step(before, x), _kernels_per_step(gm, x)
    print(f"{mode}: CUDA kernels per step {k_before} -> {k_after}; "
          f"estimate {report.launches_before} -> {report.launches_after}")
    assert k_after < k_before
