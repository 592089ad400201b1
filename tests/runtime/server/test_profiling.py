"""POST /start_profile and /stop_profile: a trace of N engine steps that `k3compile report` reads."""
import httpx
import pytest

from k3compile.report import analyze, load_trace

from .conftest import MODEL


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_profile_n_steps_of_a_running_server(server, tmp_path):
    http = httpx.Client(base_url=server.base_url, timeout=60)
    assert http.post("/stop_profile").status_code == 409          # nothing running yet
    assert http.post("/start_profile", json={"num_steps": 0}).status_code == 400
    r = http.post("/start_profile", json={"num_steps": 3, "output_dir": str(tmp_path)})
    assert r.status_code == 200 and r.json()["status"] == "armed"
    assert http.post("/start_profile", json={"num_steps": 3}).status_code == 409  # one at a time
    server.client().completions.create(model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0)
    profiler = server.app.state.profiler
    assert profiler.done.wait(60)
    server.wait_idle()
    report = analyze(load_trace(profiler.last_trace))
    assert report.step_source == "annotations"
    assert [s.name for s in report.steps] == ["k3.step#0", "k3.step#1", "k3.step#2"]
    assert all(s.cpu_ops > 0 for s in report.steps)  # CPU-only: the steps' torch ops are in the trace


def test_stop_profile_ends_an_open_ended_profile(server, tmp_path):
    http = httpx.Client(base_url=server.base_url, timeout=60)
    assert http.post("/start_profile", json={"output_dir": str(tmp_path)}).status_code == 200
    server.client().completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0)
    assert http.post("/stop_profile").status_code == 200
    server.client().completions.create(model=MODEL, prompt="k3", max_tokens=2, temperature=0)  # next step writes
    profiler = server.app.state.profiler
    assert profiler.done.wait(60)
    assert str(tmp_path) in profiler.last_trace
    assert len(analyze(load_trace(profiler.last_trace)).steps) >= 4
