"""LLMEngine on two GPUs (NCCL between the ranks, decode CUDA graphs that capture the collectives, the
control channel on gloo): greedy tokens identical to the single-GPU engine. Needs two CUDA devices."""
import pytest
import torch

from k3compile.runtime.engine import EngineArgs, LLMEngine

from .test_parallel_engine import KW, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("topology", ["tp2", "dcp2"])
def test_two_gpus_match_one(topology):
    kw = dict(KW, device="cuda", dtype="fp32")
    want = run(EngineArgs(model="k3-tiny", **kw))
    assert run(EngineArgs(model="k3-tiny", topology=topology, **kw)) == want
