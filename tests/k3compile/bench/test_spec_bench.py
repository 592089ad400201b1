"""profile verify + bench spec at tiny size on CPU: files written, fields filled, outputs as without speculation."""
import json
import weakref

from k3compile.cli import main
from k3compile.runtime.engine import LLMEngine


def test_profile_verify_then_bench_spec(tmp_path, monkeypatch):
    alive, init = [], LLMEngine.__init__

    def one_engine_at_a_time(self, *a, **kw):  # an arm's pools must be freed before the next arm sizes its own
        assert not [r for r in alive if r() is not None], "the previous arm's engine is still alive"
        alive.append(weakref.ref(self))
        init(self, *a, **kw)

    monkeypatch.setattr(LLMEngine, "__init__", one_engine_at_a_time)
    prof_dir = tmp_path / "profiles"
    assert main(["profile", "verify", "--model", "k3-tiny", "--batch", "1,2", "--tokens", "3", "--context", "8",
                 "--steps", "1", "--warmup", "0", "--out", str(prof_dir)]) == 0
    prof = json.loads((prof_dir / "cpu__k3-tiny.json").read_text())
    assert prof["batch_sizes"] == [1, 2] and prof["verify_tokens"] == [1, 2, 3]
    assert len(prof["step_ms"]) == 2 and all(len(r) == 3 and min(r) > 0 for r in prof["step_ms"])
    assert (prof_dir / "cpu__k3-tiny.md").exists() and (prof_dir / "cpu__k3-tiny.png").exists()
    out = tmp_path / "bench"
    assert main(["bench", "spec", "--model", "k3-tiny", "--batch", "2", "--gamma", "2", "--max-new-tokens", "6",
                 "--prompt-len", "5", "--accept-p", "0.9", "--profile", str(prof_dir / "cpu__k3-tiny.json"),
                 "--memory-gib", "0.01", "--out", str(out)]) == 0
    doc = json.loads((out / "spec_k3-tiny.json").read_text())
    runs = {r["arm"]: r for r in doc["runs"]}
    assert set(runs) == {"none", "all", "trim"}
    assert runs["all"]["accept_length"] > 1 and runs["all"]["differing_requests"] == 0
    assert runs["trim"]["differing_requests"] == 0
    assert main(["bench", "spec", "--model", "k3-tiny", "--batch", "2", "--gamma", "2", "--max-new-tokens", "6",
                 "--prompt-len", "5", "--accept-p", "1", "--acceptance", "forced", "--arms", "none,all",
                 "--memory-gib", "0.01", "--out", str(tmp_path / "forced")]) == 0
    forced = {r["arm"]: r for r in json.loads((tmp_path / "forced" / "spec_k3-tiny.json").read_text())["runs"]}
    f = forced["all"]  # p = 1: every verified draft committed (the last step drafts only what max_new_tokens leaves)
    assert f["accepted"] == f["verified"] > 0 and f["accept_length"] > 2 and f["differing_requests"] is None
    kinds = {(m["model"], m["kind"]): m for m in doc["memory"]}
    assert kinds[("k3", "snapshot")]["window_bytes_per_request"] > 20 * kinds[("k3", "replay")]["window_bytes_per_request"]
    assert kinds[("k3", "replay")]["max_concurrent_requests"] > kinds[("k3", "snapshot")]["max_concurrent_requests"]
