"""KDA decode launch layouts (model_def/ops/kda_launch.py): "s8" is session 8's rule exactly (the fold and the
verify-inputs kernel used to mirror it), "wide" is kda8's fastest batch-1 launch, names are checked."""
import pytest

from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, LAYOUTS, KDALaunch, check_layout, kda_launch


def _session8(batch, heads, head_k, head_v):
    """kda_decode.default_v_split, the block width and the num_warps rule as they stood in session 8."""
    split = 1
    if batch * heads <= 128:
        while split < 4 and head_v % (2 * split) == 0 and head_v // (2 * split) >= 16:
            split *= 2
    bk = 1 << (head_k - 1).bit_length()
    bv = min(1 << (head_v // split - 1).bit_length(), 32)
    return KDALaunch(split, bv, 4 if bk * bv >= 64 * 32 else 1)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8, 64, 256])
@pytest.mark.parametrize("heads,dim", [(2, 16), (4, 64), (12, 128), (32, 128), (3, 8), (1, 32)])
def test_s8_is_the_session_8_rule(batch, heads, dim):
    assert DEFAULT_LAYOUT == "s8"
    assert kda_launch("s8", batch, heads, dim, dim) == _session8(batch, heads, dim, dim)


def test_wide_at_the_48b_shape():
    # kda8's sweep: split 2 / 64 columns / 8 warps was the fastest batch-1 launch (8.36 us vs 8.61)
    assert kda_launch("wide", 1, 32, 128, 128) == KDALaunch(2, 64, 8)
    assert kda_launch("wide", 4, 32, 128, 128) == KDALaunch(2, 64, 8)  # 128 rows: still split
    assert kda_launch("wide", 8, 32, 128, 128) == kda_launch("s8", 8, 32, 128, 128) == KDALaunch(1, 32, 4)
    assert kda_launch("wide", 1, 2, 64, 64) == KDALaunch(2, 32, 4)  # smaller heads: fewer warps
    assert kda_launch("wide", 1, 2, 16, 16) == KDALaunch(1, 16, 1)  # 8-column parts are too narrow


def test_unknown_layout_is_named():
    assert set(LAYOUTS) >= {"s8", "wide"}
    assert check_layout("wide") == "wide"
    with pytest.raises(ValueError, match="unknown KDA decode launch layout 'fast'; expected one of s8, wide"):
        kda_launch("fast", 1, 32, 128, 128)
