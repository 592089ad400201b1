"""profile verify + bench spec at tiny size on CPU: files written, fields filled, outputs as without speculation."""
import json

from k3compile.cli import main


def test_profile_verify_then_bench_spec(tmp_path):
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
    kinds = {(m["model"], m["kind"]): m for m in doc["memory"]}
    assert kinds[("k3", "snapshot")]["window_bytes_per_request"] > 20 * kinds[("k3", "replay")]["window_bytes_per_request"]
    assert kinds[("k3", "replay")]["max_concurrent_requests"] > kinds[("k3", "snapshot")]["max_concurrent_requests"]
