"""`k3compile serve k3-tiny --topology tp2`: the command starts the second rank itself; the official openai
client gets the single-process engine's greedy tokens (chunked prefill, a prefix-cache hit); a rank
killed mid-serve fails the request in flight, and a hung one shuts an idle server down, each with an
error naming the rank, within the timeout and with no rank process left behind."""
import os
import signal
import time

import pytest

from .served import AGAIN, PROMPT, Served, alive, children, reference


@pytest.mark.timeout(300)
def test_tp2_serves_the_openai_client_then_a_killed_rank_shuts_it_down():
    import openai
    want = reference([PROMPT, AGAIN], 6)
    s = Served("k3-tiny", "--topology", "tp2", "--rank-timeout", "30")
    try:
        assert len(s.ranks) == 1
        s.check_greedy(want)

        stream = s.complete(PROMPT, 300, stream=True)
        next(iter(stream))  # the request is running on both ranks
        t0 = time.monotonic()
        os.kill(s.ranks[0], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="rank 1: process killed by SIGKILL"):
            for _ in stream:
                pass
        code, out = s.exit(60)
        assert time.monotonic() - t0 < 60
    finally:
        s.stop()
    assert code == 1 and "shut down: rank 1: process killed by SIGKILL" in out, out
    assert not any(alive(p) for p in s.ranks + children(s.proc.pid))


@pytest.mark.timeout(300)
def test_a_hung_rank_of_an_idle_server_shuts_it_down_within_the_timeout():
    s = Served("k3-tiny", "--topology", "tp2", "--rank-timeout", "6")
    try:
        os.kill(s.ranks[0], signal.SIGSTOP)  # frozen: alive, but silent
        t0 = time.monotonic()
        code, out = s.exit(60)
        assert time.monotonic() - t0 < 30
    finally:
        s.stop()
        for p in s.ranks:
            if alive(p):
                os.kill(p, signal.SIGKILL)
                pytest.fail(f"rank process {p} outlived the server")
    assert code == 1 and "shut down: rank 1: hung: no heartbeat for" in out, out
