"""Sampling is numerically safe for every value SamplingParams accepts (hypothesis over the whole
range: subnormal and huge temperatures, top_p down to the smallest double, any top_k, any seed)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.runtime.sampling import SEED_RANGE, SamplingParams, sample

temperatures = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-6, 1e-5, 1.0, 1e30, 1e308]),
                         st.floats(0, 1e308, allow_nan=False, allow_infinity=False))
top_ps = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 1e-6, 0.5, 1.0]),
                   st.floats(0, 1, exclude_min=True, allow_nan=False))
logits_scale = st.sampled_from([0.0, 1e-30, 1.0, 1e4, 1e30, 1e37])  # finite in fp32


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(temperatures, top_ps, st.integers(0, 2**70), st.integers(*SEED_RANGE), logits_scale, st.integers(0, 2**31))
def test_every_accepted_value_samples_a_token(temperature, top_p, top_k, seed, scale, data_seed):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(data_seed)) * scale
    token = sample(logits, params, params.generator())
    assert 0 <= token < 50
