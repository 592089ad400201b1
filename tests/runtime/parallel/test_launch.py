"""The rank launcher: results in rank order; a rank that raises, dies or hangs is a RankFailure naming
it within the timeout, and no rank process outlives the call."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from k3compile.model_def.parallel.topology import parse_topology
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import RankFailure, launch


def _sum_ranks(rank, topology):
    init_rank(parse_topology(topology), "gloo", timeout_s=20)
    try:
        out = torch.ops.k3.all_reduce(torch.tensor([float(rank + 1)]), "world")
        got = torch.ops.k3.all_to_all(torch.arange(2.0) + 10 * rank, "dcp") if dist.get_world_size() == 4 else None
        return out.item(), got, os.environ["RANK"], os.getpid()
    finally:
        shutdown_rank()


def test_results_in_rank_order_with_torchrun_env():
    res = launch(_sum_ranks, 4, ("tp2-dcp2",), timeout_s=60)
    assert [r[0] for r in res] == [10.0] * 4
    assert [r[2] for r in res] == ["0", "1", "2", "3"]
    # DCP groups {0, 1} and {2, 3}: chunk g of the result came from group rank g
    assert res[0][1].tolist() == [0.0, 10.0] and res[1][1].tolist() == [1.0, 11.0]
    assert res[2][1].tolist() == [20.0, 30.0] and res[3][1].tolist() == [21.0, 31.0]


def _one_rank_dies(rank):
    init_rank(parse_topology("tp2"), "gloo", timeout_s=30)
    if rank == 1:
        os._exit(3)  # killed: no error message, no result
    torch.ops.k3.all_reduce(torch.ones(1), "world")
    return "unreachable"


def _one_rank_hangs(rank):
    init_rank(parse_topology("tp2"), "gloo", timeout_s=30)
    if rank == 1:
        time.sleep(600)
    torch.ops.k3.all_reduce(torch.ones(1), "world")


def _one_rank_raises(rank):
    if rank == 1:
        raise ValueError("bad shard")
    return rank


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_rank_is_an_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1: process exited with code 3"):
        launch(_one_rank_dies, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30  # found by the exit, long before any timeout


def test_a_hung_rank_is_an_error_within_the_timeout():
    with pytest.raises(RankFailure, match=r"no result within 4s"):
        launch(_one_rank_hangs, 2, timeout_s=4)


def test_a_raising_rank_reports_its_traceback():
    with pytest.raises(RankFailure, match="(?s)rank 1: raised.*ValueError: bad shard"):
        launch(_one_rank_raises, 2, timeout_s=30)
