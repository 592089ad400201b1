"""KDA decode launch layouts (model_def/ops/kda_launch.py): "s8" is session 8's rule exactly (the fold and the
verify-inputs kernel used to mirror it) and the only layout ("wide" was dropped in session 9); names are
checked."""
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


def test_s8_at_the_48b_shape():
    assert kda_launch("s8", 1, 32, 128, 128) == KDALaunch(4, 32, 4)  # 8.61 us alone on the H200 (kda8)
    assert kda_launch("s8", 4, 32, 128, 128) == KDALaunch(4, 32, 4)  # 128 rows: still split
    assert kda_launch("s8", 8, 32, 128, 128) == KDALaunch(1, 32, 4)


@pytest.mark.parametrize("name", ["wide", "fast"])
def test_unknown_layout_is_named(name):
    assert set(LAYOUTS) == {"s8"}
    assert check_layout("s8") == "s8"
    with pytest.raises(ValueError, match=f"unknown KDA decode launch layout '{name}'; expected one of s8$"):
        kda_launch(name, 1, 32, 128, 128)
