"""Kernel and op names land in the right model part; the rule order settles names that match twice."""
import pytest

from k3compile.report.categories import CATEGORIES, classify

CASES = [
    # GEMM: cuBLAS (nvjet on Hopper), CUTLASS, Inductor templates, torch ops
    ("nvjet_sm90_hsh_8x64_64x16_4x1_v_bz_bias_TNN", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)", "GEMM"),
    ("triton_tem_fused_mm_0", "GEMM"),
    ("aten::addmm", "GEMM"),
    ("aten::linear", "GEMM"),
    ("aten::mm", "GEMM"),
    # KDA: fla kernels, the short conv, our ops and Triton kernels
    ("chunk_kda_fwd_kernel_o", "KDA"),
    ("fused_recurrent_kda_fwd_kernel", "KDA"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "KDA"),
    ("causal_conv1d_update_kernel", "KDA"),
    ("k3::kda_decode", "KDA"),
    ("k3::short_conv_decode", "KDA"),
    ("k3_kda_decode_kernel", "KDA"),
    # attention
    ("flash_fwd_splitkv_kernel", "attention"),
    ("k3::mla_decode", "attention"),
    ("k3::kv_write", "attention"),
    ("aten::scaled_dot_product_attention", "attention"),
    # AttnRes is a softmax over residuals, not attention
    ("k3::attn_res", "norm/elementwise"),
    # MoE
    ("fused_moe_kernel", "MoE"),
    ("k3::fused_route", "MoE"),
    ("_fused_route_kernel", "MoE"),
    ("k3::moe_experts", "MoE"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(TensorInfo)", "MoE"),
    ("aten::topk", "MoE"),
    # norm / elementwise
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float, false>(int)", "norm/elementwise"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm/elementwise"),
    ("triton_poi_fused_add_copy_1", "norm/elementwise"),
    ("void at::native::vectorized_elementwise_kernel<8, GeluCUDAKernelImpl>(int)", "norm/elementwise"),
    ("aten::gelu", "norm/elementwise"),
    ("aten::add", "norm/elementwise"),
    ("k3_rmsnorm_kernel", "norm/elementwise"),
    # copy
    ("Memcpy DtoH (Device -> Pageable)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda(TensorIteratorBase&)>(int)", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 2, 64, 64>()", "copy"),
    ("aten::cat", "copy"),
    ("aten::copy_", "copy"),
    # communication
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("c10d::allreduce_", "communication"),
    ("cross_device_reduce_1stage", "communication"),
    # other: views and sorts must not be caught by short substrings
    ("aten::expand", "other"),
    ("aten::chunk", "other"),
    ("aten::view", "other"),
    ("aten::empty", "other"),
    ("void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>()", "other"),
]


@pytest.mark.parametrize("name,expected", CASES)
def test_classify(name, expected):
    assert classify(name) == expected


def test_every_result_is_a_listed_category():
    assert {classify(n) for n, _ in CASES} <= set(CATEGORIES)
    assert {expected for _, expected in CASES} == set(CATEGORIES)
