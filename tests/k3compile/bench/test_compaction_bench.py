"""bench compaction on CPU at tiny sizes: each repetition really moves one slot and one page."""
import torch

import k3compile
from k3compile.bench.compaction import measure, render


def test_each_rep_moves_one_block_of_each_kind():
    model = k3compile.load_model("k3-tiny")
    res = measure(model, batch_size=2, context=20, page_size=4, spare_slots=2, steps=1, reps=3, warmup=1,
                  device=torch.device("cpu"))
    stats = res["compaction_stats"]
    assert stats["slot"]["moves"] == 3 and stats["page"]["moves"] == 3
    assert stats["slot"]["bytes_moved"] == 3 * res["slot_bytes"]
    assert stats["page"]["bytes_moved"] == 3 * res["page_bytes"]
    assert res["slot_move_vs_decode_pct"] > 0
    md = render({"result": res, "environment": {"device": {"name": "cpu"}},
                 "config": {"model": "k3-tiny", "dtype": "fp32", "batch": 2, "context": 20, "reps": 3, "steps": 1,
                            "page_size": 4}})
    assert "state slot" in md
