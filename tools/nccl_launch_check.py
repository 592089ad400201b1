"""A rank launch through runtime/parallel/launch.py with NCCL (spawn start method): every visible GPU one rank,
an all-reduce of ones through the k3 op. Usage: python3 tools/nccl_launch_check.py [WORLD]"""
import sys

import torch

from k3compile.model_def.parallel.topology import Topology
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import launch


def one(rank, world):
    torch.cuda.set_device(rank)
    init_rank(Topology(world, 1), "nccl", timeout_s=30, device_id=torch.device(f"cuda:{rank}"))
    try:
        return torch.ops.k3.all_reduce(torch.ones(4, device="cuda"), "world").sum().item()
    finally:
        shutdown_rank()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    print(f"nccl launch ({world} rank(s), spawn): sums {launch(one, world, (world,), timeout_s=60, start_method='spawn')} "
          f"(expect {4.0 * world} each)")
