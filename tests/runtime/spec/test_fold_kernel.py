"""The ReplaySSM fold kernel against the torch reference (CPU, interpreter) and commit's checks."""
from pathlib import Path

import pytest
import torch

from k3compile.model_def.cache import CacheSpec, CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
from k3compile.runtime.spec import fold_kernel
from tests.passes.kernels.interpreted import run_interpreted


def test_fold_kernel_under_interpreter_matches_reference():
    run_interpreted(Path(__file__).with_name("interpret_fold.py"), timeout=600)


def test_commit_refuses_bad_accept_lengths_and_layouts():
    spec = CacheSpec(n_kda=1, kda_heads=1, kda_head_k=4, kda_head_v=4, conv_channels=12, conv_window=3, n_mla=1,
                     kv_width=4, dtype=torch.float32)
    cache = CacheTensors.allocate(spec, 3, 1, 4)
    w = DraftWindow.allocate(DraftWindowSpec(spec, 3), 2)
    with pytest.raises(ValueError, match="outside"):
        fold_kernel.commit(cache, w, [1, 2], [1, 4])
    with pytest.raises(ValueError, match="accept lengths"):
        fold_kernel.commit(cache, w, [1, 2], [1])
    with pytest.raises(ValueError, match="rows"):
        fold_kernel.commit(cache, w, [0, 1, 2], [1, 1, 1])
    with pytest.raises(ValueError, match="unknown KDA decode launch layout 'fast'"):
        fold_kernel.commit(cache, w, [1, 2], [1, 1], layout="fast")


def test_the_fold_follows_the_engines_p5_launch_layout():
    from k3compile.runtime.spec.setup import kda_launch_layout

    def p5(launch):
        return {"build": {"pipeline": {"order": ["p05_fused_kda_decode"],
                                       "passes": {"p05_fused_kda_decode": {"enabled": True, "launch": launch}}}}}
    assert kda_launch_layout(p5("s8")) == "s8"
    # an engine built with "wide" (dropped in session 9): refused before a step runs
    with pytest.raises(ValueError, match="unknown KDA decode launch layout 'wide'; expected one of s8"):
        kda_launch_layout(p5("wide"))
    # no engine, an engine built without passes, or before P5 had the option: the default layout
    assert kda_launch_layout(None) == kda_launch_layout({"build": {"pipeline": None}}) == "s8"
    assert kda_launch_layout({"build": {"pipeline": {"passes": {"p05_fused_kda_decode": {"enabled": True}}}}}) == "s8"
