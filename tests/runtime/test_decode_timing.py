"""`EngineArgs.step_timing`: every decode forward is timed under the batch size it runs at (its bucket when decode
batches are padded), prefill forwards are not, the warm-up's are forgotten, and metrics() carries the totals."""
import pytest

from k3compile.runtime.decode_timing import DecodeTimer
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams


def _engine(**kw):
    return LLMEngine(EngineArgs(model="k3-tiny", memory_bytes=16 << 20, step_timing=True, **kw))


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def test_timer_totals_per_bucket_and_reset():
    t = DecodeTimer(cuda=False)
    for bucket in (1, 1, 4):
        t.stop(t.start(bucket))
    totals = t.totals()
    assert {b: n for b, (n, _) in totals.items()} == {1: 2, 4: 1}
    assert all(s >= 0 for _, s in totals.values())
    t.reset()
    assert t.totals() == {}


@pytest.mark.parametrize("pad, bucket", [(False, "3"), (True, "4")])
def test_engine_times_each_decode_forward_at_its_batch_size(pad, bucket):
    eng = _engine(pad_decode_batches=pad)
    try:
        assert eng.metrics()["decode_forward"] == {}
        # three short prompts prefill in one batch (the first token each), then 4 decode steps of all three
        out = eng.generate([[1, 2, 3], [4, 5, 6, 7], [8, 9]], _greedy(5))
        assert [len(o) for o in out] == [5, 5, 5]
        fwd = eng.metrics()["decode_forward"]
        assert set(fwd) == {bucket} and fwd[bucket]["forwards"] == 4 and fwd[bucket]["seconds"] > 0
    finally:
        eng.close()


def test_warmup_forgets_its_forwards_and_off_means_no_figures():
    eng = _engine()
    try:
        eng.warmup()
        assert eng.metrics()["decode_forward"] == {}
        eng.generate([[5, 6]], _greedy(3))
        assert eng.metrics()["decode_forward"]["1"]["forwards"] == 2
    finally:
        eng.close()
    plain = LLMEngine(EngineArgs(model="k3-tiny", memory_bytes=16 << 20))
    try:
        plain.generate([[5, 6]], _greedy(2))
        assert plain.runner.timer is None and "decode_forward" not in plain.metrics()
    finally:
        plain.close()


@pytest.mark.gpu
def test_cuda_events_time_graph_replays_per_bucket():
    """On CUDA the decode batches replay the bucket's graph: 3 requests run at bucket 4, timed by events."""
    eng = _engine(device="cuda", dtype="bf16")
    try:
        eng.generate([[1, 2, 3], [4, 5, 6, 7], [8, 9]], _greedy(5))
        fwd = eng.metrics()["decode_forward"]
        # 4 decode steps; with overlap (on for CUDA) a step may be launched for rows that finished meanwhile
        assert set(fwd) == {"4"} and 4 <= fwd["4"]["forwards"] <= 5
        assert 0 < fwd["4"]["seconds"] / fwd["4"]["forwards"] < 1.0   # device time of a k3-tiny step: well under 1 s
    finally:
        eng.close()
