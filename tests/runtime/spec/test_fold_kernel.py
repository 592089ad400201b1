"""The ReplaySSM fold kernel against the torch reference (CPU, interpreter) and commit's checks."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3compile.model_def.cache import CacheSpec, CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
from k3compile.runtime.spec import fold_kernel


def test_fold_kernel_under_interpreter_matches_reference():
    script = Path(__file__).with_name("interpret_fold.py")
    done = subprocess.run([sys.executable, str(script)], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cases match" in done.stdout


def test_commit_refuses_bad_accept_lengths():
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


def test_fold_blocks_mirror_p5_launch_heuristics():
    from k3compile.passes.kernels import kda_decode as p5

    names = ("V_BLOCK", "MAX_ROWS_TO_SPLIT", "MAX_V_SPLIT", "MIN_V_PER_PROGRAM")
    assert [getattr(fold_kernel, n) for n in names] == [getattr(p5, n) for n in names]
    for batch in (1, 3, 8, 64, 256):
        for heads, dim in ((2, 16), (4, 64), (12, 128), (32, 128)):
            split = p5.default_v_split(batch, heads, dim)
            bv = min(1 << (dim // split - 1).bit_length(), p5.V_BLOCK)
            assert fold_kernel.p5_block(batch, heads, dim, dim) == (bv, 4 if dim * bv >= 64 * 32 else 1)
