"""The LSE merge is exact against full attention, empty shards included; the DCP partial attention
over position shards, merged, equals the whole-cache absorbed MLA decode."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.model_def.parallel.lse_merge import merge_pair, merge_partials

from .helpers import dcp_decode_vs_full


def _attend(q, k, v):
    """One shard's (o, lse) the way a kernel returns them; an empty key set gives (NaN, -inf)."""
    s = q @ k.t()
    lse = torch.logsumexp(s, -1) if k.shape[0] else torch.full(q.shape[:-1], -math.inf, dtype=torch.float64)
    o = torch.softmax(s, -1) @ v if k.shape[0] else torch.full(q.shape[:-1] + (v.shape[-1],), math.nan,
                                                                dtype=torch.float64)
    return o, lse


@settings(max_examples=40, deadline=None)
@given(n_keys=st.integers(0, 40), shards=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_merge_equals_full_attention(n_keys, shards, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 8, generator=g, dtype=torch.float64) * 3
    k = torch.randn(n_keys, 8, generator=g, dtype=torch.float64)
    v = torch.randn(n_keys, 5, generator=g, dtype=torch.float64)
    parts = [_attend(q, k[r::shards], v[r::shards]) for r in range(shards)]  # position p on shard p mod R
    o, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    if n_keys == 0:
        assert torch.equal(o, torch.zeros(3, 5)) and torch.isneginf(lse).all()
        return
    full_o, full_lse = _attend(q, k, v)
    assert torch.allclose(o.double(), full_o, atol=2e-6, rtol=1e-5)
    assert torch.allclose(lse.double(), full_lse, atol=2e-6, rtol=1e-6)


def test_merge_is_associative_pairwise():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(3, 4, 6, generator=g)
    lse = torch.randn(3, 4, generator=g)
    lse[1, 2] = -math.inf
    ab = merge_pair(o[0], lse[0], o[1], lse[1])
    abc = merge_pair(ab[0], ab[1], o[2], lse[2])
    whole = merge_partials(o, lse)
    assert torch.allclose(abc[0], whole[0], atol=1e-6) and torch.allclose(abc[1], whole[1], atol=1e-6)


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        merge_partials(torch.zeros(2, 3, 4), torch.zeros(2, 4))


@pytest.mark.parametrize("dcp", [1, 2, 3, 8])
def test_partials_over_position_shards_merge_to_full_decode(dcp):
    """Requests of 1, 2 and 13 tokens: with 8 shards most ranks hold nothing for the short ones."""
    merged, full, lses = dcp_decode_vs_full([1, 2, 13], dcp, heads=3, width=24, rank_r=16, page=4, scale=0.3,
                                            seed=dcp)
    if dcp == 8:
        assert torch.isneginf(lses[2:, 0]).all()  # the 1-token request lives on rank 0 only
    assert torch.allclose(merged, full, atol=1e-5, rtol=1e-5)
