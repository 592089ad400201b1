"""`k3compile plan` / `info --topology`: tables from the rank models, capacity arithmetic, clear errors."""
import pytest
import torch

from k3compile.cli import main
from k3compile.model_def.config import ConfigError, get_preset
from k3compile.model_def.parallel.plan import rank_plan
from k3compile.model_def.parallel.topology import Topology
from k3compile.plan import parse_bytes, plan_topologies, render_plan


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("80 GiB") == 80 << 30 and parse_bytes("1e9") == 10**9
    with pytest.raises(ConfigError, match="cannot read a memory size"):
        parse_bytes("lots")


def test_rows_for_eight_gpus():
    assert [t.name for _, t in plan_topologies(8)] == ["tp8", "tep8", "dcp8", "tp2-dcp4", "tp4-dcp2"]


def test_capacity_arithmetic():
    cfg = get_preset("k3-tiny")
    tp, dcp = rank_plan(cfg, Topology(2, 1, "tp")), rank_plan(cfg, Topology(1, 2))
    whole = rank_plan(cfg, Topology(1, 1))
    assert tp.weight_bytes < whole.weight_bytes and tp.kda_slot_bytes * 2 <= whole.kda_slot_bytes + 512
    assert tp.kv_bytes_per_token == whole.kv_bytes_per_token == 3 * (16 + 8) * 2  # 3 MLA layers x 24 wide x bf16
    c = dcp.capacity(10**8, 0.5)
    assert c.kv_tokens_logical == 2 * c.kv_tokens_local == 2 * ((5 * 10**7 - dcp.weight_bytes) // 144)
    assert not tp.capacity(10**5, 0.5).fits  # weights alone exceed the budget
    assert whole.collectives == [] and {c.op for c in dcp.collectives} == {"all_reduce", "all_to_all", "all_gather"}


def test_render_plan_and_impossible_rows():
    text = render_plan(get_preset("k3-tiny"), 4, 10**9, 0.85, torch.bfloat16)
    assert "impossible: 2 KDA heads are not divisible by 4 ranks" in text
    text = render_plan(get_preset("k3-tiny"), 2, 10**9, 0.85, torch.bfloat16)
    assert "logical KV capacity: TP2" in text and "-> DCP2" in text


def test_cli_plan_and_info_topology(capsys):
    assert main(["plan", "--model", "k3-tiny", "--gpus", "2", "--gpu-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "tep2" in out and "dcp2" in out and "KDA slots" in out
    assert main(["info", "--model", "k3-tiny", "--topology", "tep2"]) == 0
    out = capsys.readouterr().out
    assert "4..7 whole" in out and "all_reduce" in out and "total sent per rank" in out
    assert main(["info", "--model", "k3-tiny", "--topology", "tp4"]) == 2  # one clear line, no traceback
    assert "2 KDA heads are not divisible by 4 ranks" in capsys.readouterr().err
