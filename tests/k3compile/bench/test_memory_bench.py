"""bench memory at toy sizes: the engine runs drain the workload, and the report compares all three."""
import k3compile
from k3compile.bench.memory import Job, compare, render, run_engine


def test_engine_run_drains_and_counts():
    model = k3compile.load_model("k3-tiny")
    jobs = [Job(0, 20, 6), Job(0, 30, 5), Job(1, 200, 4), Job(2, 12, 8)]
    for unified in (True, False):
        r = run_engine(model, jobs, 256 * 1024, 16, unified, None if unified else 0.5)
        assert r["drained"] and r["rejected"] == 0
        work = sum(j.prompt_len + j.output_len for j in jobs)
        # a retraction re-prefills what the request had, so only then is more served than the work
        assert r["tokens_served"] == work if r["retractions"] == 0 else r["tokens_served"] > work
        assert 1 <= r["max_concurrent"] <= len(jobs)


def test_compare_reports_unified_default_and_hindsight():
    model = k3compile.load_model("k3-tiny")
    jobs = [Job(i // 3, 24, 6) for i in range(9)]
    res = compare(model, jobs, 200 * 1024, 16, (0.3, 0.6))
    assert set(res) == {"unified", "default_split", "splits", "best_split"}
    assert res["best_split"]["max_concurrent"]["state_fraction"] in (0.3, 0.6)
    md = render({"config": {"model": "k3-tiny", "budget_kib": 200, "page_size": 16},
                 "engine_sizes": {"slot_bytes": 1, "page_bytes": 1}, "engine": {"toy": res}, "allocator": None})
    assert "| toy | max_concurrent |" in md
