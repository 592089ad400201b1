"""The transformers anchor (k3compile/bench/hf_arm.py) on CPU at a tiny Kimi-Linear shape: transformers' own
PyTorch fallback (fla is not installed here), same protocol fields as our arms, K3 configs refused."""
import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from k3compile.bench import hf_arm  # noqa: E402
from k3compile.model_def.config import ConfigError, get_preset  # noqa: E402


def test_k3_configs_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="transformers has no K3 architecture"):
        hf_arm.hf_config("k3-tiny")


def test_builds_the_preset_config_and_times_decode_steps_with_its_cache():
    ours = get_preset("kimi-linear-tiny")
    model = hf_arm.build_hf_model("kimi-linear-tiny", torch.float32, torch.device("cpu"), seed=0)
    assert model.config.num_hidden_layers == ours.num_hidden_layers and model.config.vocab_size == ours.vocab_size
    assert [t == "full_attention" for t in model.config.layer_types] == [t == "mla" for t in ours.layer_types]
    with torch.no_grad():
        row = hf_arm.measure_batch(model, 2, context=6, steps=2, warmup=1, reps=2, device=torch.device("cpu"),
                                   seed=0)
    assert row["status"] == "ok" and len(row["samples_ms"]) == 2 and row["steps_per_rep"] == 2
    assert row["min_ms"] <= row["median_ms"] <= row["max_ms"]
    # prompt 5 tokens, then first step + 1 warm-up + 2 x 2 timed + 2 profiled decode steps, one token each
    assert (row["context_first"], row["context_last"]) == (6, 5 + 1 + 1 + 4 + 2)
    assert row["cpu_ops_per_step"] > 0 and row["profiled_steps"] == 2 and "trace" not in row


def test_command_runs_this_module_under_the_same_interpreter(tmp_path):
    cmd = hf_arm.command("kimi-linear-48b", "bf16", [1, 8], 512, "cuda", 20, 3, 5, 0, 60.0, str(tmp_path / "x.json"))
    assert cmd[:3] == [sys.executable, "-m", "k3compile.bench.hf_arm"]
    args = hf_arm.parser().parse_args(cmd[3:])
    assert (args.batch, args.context, args.steps, args.time_budget) == ("1,8", 512, 20, 60.0)


def test_error_is_written_not_raised(tmp_path):
    out = tmp_path / "hf.json"
    assert hf_arm.run(hf_arm.parser().parse_args(["--model", "k3-tiny", "--device", "cpu", "--out", str(out)])) == 1
    doc = json.load(open(out))
    assert "transformers has no K3 architecture" in doc["error"] and doc["results"] == []
