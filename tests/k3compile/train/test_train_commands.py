"""`k3compile train` and `k3compile train-draft` end to end at a handful of steps: seeded runs repeat
exactly, checkpoints load, curves are written, and the measured speculative decoding reproduces plain
greedy decoding of the trained target."""
import json

import pytest
import torch

import k3compile
from k3compile.cli import main
from k3compile.model_def.drafter_checkpoint import load_drafter

SMALL = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2", "--corpus-bytes", "300000"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    assert main(["train", "--out", str(out), *SMALL]) == 0
    return out


def test_train_writes_a_loadable_checkpoint_and_repeats_exactly(target_dir, tmp_path):
    curves = json.load(open(target_dir / "target_loss.json"))
    assert [r["step"] for r in curves["train"]] == [1, 2] and [r["step"] for r in curves["val"]] == [0, 2]
    assert curves["meta"]["corpus"]["source"] == "python-stdlib"
    model = k3compile.load_model(str(target_dir))
    assert model.config.vocab_size == 512
    assert main(["train", "--out", str(tmp_path), *SMALL]) == 0
    again = json.load(open(tmp_path / "target_loss.json"))
    assert again["train"] == curves["train"]


def test_train_draft_then_lossless_speculation(target_dir, tmp_path):
    args = ["train-draft", "--target", str(target_dir), "--out", str(tmp_path), *SMALL, "--anchors", "2",
            "--block-size", "4", "--accept-gammas", "2,4", "--accept-prompts", "2", "--accept-tokens", "8", "--accept-prompt-len", "16"]
    assert main(args) == 0
    curves = json.load(open(tmp_path / "drafter_loss.json"))
    assert {"ce", "l1", "bce", "expected_accept"} <= set(curves["train"][0])
    load_drafter(str(tmp_path), k3compile.load_model(str(target_dir)))
    acc = json.load(open(tmp_path / "acceptance.json"))
    for g, row in acc["by_gamma"].items():
        assert row["outputs_equal_plain_greedy"] == "2/2"
        assert 1.0 <= row["tau"] <= int(g) + 1
