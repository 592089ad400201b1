"""Which part of the model a GPU kernel (or, on CPU-only traces, a torch op) belongs to.

One ordered rule table, matched against the lower-cased name; the first rule that matches wins.
The order encodes the judgment calls: a layer family (KDA, attention, MoE) beats the kind of op, so
an MoE expert GEMM counts as MoE and not GEMM; compiler-generated pointwise kernels
(`triton_poi_fused__to_copy_add…`) are elementwise even when their name mentions a copy, while a
hand-written `direct_copy_kernel` is a copy. Our own ops (`k3::kda_decode`, `k3::fused_route`, …)
and Triton kernels (`k3_…`) are named after what they do, so the same substrings place them.
"""
from __future__ import annotations

import functools
import re

GEMM = "GEMM"
KDA = "KDA"
ATTENTION = "attention"
MOE = "MoE"
NORM_ELEMENTWISE = "norm/elementwise"
COPY = "copy"
COMMUNICATION = "communication"
OTHER = "other"

# Display order in reports.
CATEGORIES = (GEMM, KDA, ATTENTION, MOE, NORM_ELEMENTWISE, COPY, COMMUNICATION, OTHER)

# A short op name such as `mm` or `add` must stand alone (`aten::mm`, `triton_tem_fused_mm_0`),
# or it would match inside `comm`, `summary`, `padding`.
def _word(*names: str) -> str:
    return r"(?:^|[^a-z0-9])(?:" + "|".join(names) + r")(?:[^a-z0-9]|$)"


_RULES: tuple[tuple[str, str], ...] = (
    (COMMUNICATION, r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|c10d|"
                    r"cross_device_reduce|sendrecv|" + _word("send", "recv", "broadcast")),
    # KDA layers: fla's chunked/recurrent kernels, the short causal conv, our k3::kda_* ops.
    (KDA, r"kda|fused_recurrent|delta_rule|chunk_(?:gla|gated|local_cumsum|scaled_dot_kkt|fwd)|"
          r"solve_tril|recompute_w_u|conv1d|short_conv|conv_update"),
    # Block Attention Residuals is a softmax over a bank of residuals, not attention over tokens.
    (NORM_ELEMENTWISE, r"attn_?res"),
    (ATTENTION, r"flash|fmha|sdpa|scaled_dot_product|attention|attn|mla|kv_write|kv_cache|"
                r"reshape_and_cache|paged"),
    (MOE, r"moe|expert|rout(?:e|er|ing)|topk|grouped_?gemm|group_gemm"),
    (GEMM, r"gemm|gemv|cutlass|xmma|cublas|nvjet|matmul|splitk|" +
           _word("mm", "addmm", "bmm", "baddbmm", "linear", "addmv", "mv")),
    # Inductor's pointwise/persistent-reduction/reduction kernels.
    (NORM_ELEMENTWISE, r"^triton_(?:poi|per|red)_"),
    (COPY, r"memcpy|memset|copy|clone|contiguous|fillfunctor|catarray|gather|scatter|index|" +
           _word("cat", "stack", "to", "fill", "fill_", "zero_", "zeros")),
    (NORM_ELEMENTWISE, r"rms|norm|elementwise|vectorized|reduce|softmax|gelu|silu|situ|sigmoid|"
                       r"tanh|rsqrt|activation|act_and_mul|" +
                       _word("exp", "add", "add_", "mul", "mul_", "sub", "div", "neg", "pow", "mean", "sum",
                             "where", "clamp", "relu")),
)
_COMPILED = tuple((category, re.compile(pattern)) for category, pattern in _RULES)


@functools.lru_cache(maxsize=65536)
def classify(name: str) -> str:
    """The category of a kernel or op name; `other` when no rule matches."""
    lowered = name.lower()
    for category, pattern in _COMPILED:
        if pattern.search(lowered):
            return category
    return OTHER
