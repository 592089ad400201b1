"""`k3compile generate --engine DIR` gives the same greedy tokens as `--model` (CPU, fp32, same seed), for an
engine built through the API (k3-tiny) and one built with `k3compile build` (kimi-linear-tiny)."""
from k3compile.passes.pipeline import PipelineConfig
import json
import os

import pytest

from k3compile import cli

PROMPT = "def fib(n):"


@pytest.fixture
def main(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, *(c for c in ("build",) if c not in cli.COMMANDS)])
    return cli.main


def generated_ids(main, capsys, *source):
    assert main(["generate", *source, "--prompt", PROMPT, "--max-new-tokens", "12", "--show-ids"]) == 0
    out = capsys.readouterr().out
    return [int(t) for t in out.rsplit("ids:", 1)[1].split()]


def test_k3_tiny_engine_generates_the_model_tokens(main, capsys, built_engine):
    _, path = built_engine("k3-tiny")
    want = generated_ids(main, capsys, "--model", "k3-tiny")
    assert len(want) == 12 and len(set(want)) > 1
    assert generated_ids(main, capsys, "--engine", path) == want


def test_build_command_then_generate(main, capsys, tmp_path):
    out = str(tmp_path / "kl")
    assert main(["build", "--model", "kimi-linear-tiny", "--topology", "single", "--dtype", "fp32",
                 "--disable-pass", "p03", "-o", out]) == 0
    err = capsys.readouterr().err
    for stage in ("loading kimi-linear-tiny", "capturing the decode step", "p01_gemm_merge:", "saving the engine"):
        assert stage in err
    m = json.load(open(os.path.join(out, "engine.json")))
    assert [p["name"] for p in m["passes"]["decode"]["passes"]] == [
        n for n in PipelineConfig.default().enabled_passes() if n != "p03_casts_copies_dce"]
    want = generated_ids(main, capsys, "--model", "kimi-linear-tiny")
    assert generated_ids(main, capsys, "--engine", out) == want
    # a second build into the same directory needs --overwrite; the error names the directory
    assert main(["build", "--model", "kimi-linear-tiny", "--dtype", "fp32", "--passes", "none", "-o", out]) == 2
    assert "not empty (pass --overwrite" in capsys.readouterr().err
    assert main(["generate", "--engine", out, "--dtype", "bf16", "--prompt", "x"]) == 2
    assert "was built for fp32" in capsys.readouterr().err
