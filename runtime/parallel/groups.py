"""Process-group set-up for one rank of a parallel engine (torchrun-compatible).

`init_rank` joins the default group (from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as torchrun
sets them, or from explicit arguments), creates the DCP groups every rank must create in the same
order, and registers the roles ("world", "dcp") the k3:: collective ops resolve. The timeout bounds
every collective: a rank that died or hangs makes the others fail with an error instead of waiting.
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from k3compile.model_def.parallel import comm
from k3compile.model_def.parallel.topology import Topology, TopologyError

DEFAULT_TIMEOUT_S = 60.0


def default_backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_rank(topology: Topology, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
              rank: int | None = None, init_method: str | None = None, device_id=None, store=None) -> int:
    """Join the process group of `topology` and register its roles; returns this process's rank.
    `store`: a key-value store to rendezvous through (see `env_store`) instead of `init_method`."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", topology.world))
    if world != topology.world:
        raise TopologyError(f"{topology.name} needs {topology.world} ranks, but WORLD_SIZE is {world}")
    if not dist.is_initialized():
        kw = {"device_id": device_id} if device_id is not None else {}
        kw.update({"store": store} if store is not None else {"init_method": init_method or "env://"})
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
    groups = {"world": dist.group.WORLD}
    if topology.dcp > 1:
        for t in range(topology.tp):  # every rank creates every group, in the same order
            ranks = [t * topology.dcp + d for d in range(topology.dcp)]
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                groups["dcp"] = g
    comm.register_groups(**groups)
    return rank


def env_store(rank: int, world: int, timeout_s: float = DEFAULT_TIMEOUT_S, addr: str | None = None,
              port: int | None = None):
    """The TCP store at MASTER_ADDR:MASTER_PORT (or addr:port), as env:// would make it (rank 0 hosts
    it, unless torchrun's agent already does), kept so the caller can use it too (heartbeats)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    addr = addr or os.environ["MASTER_ADDR"]
    port = port or int(os.environ["MASTER_PORT"])
    return dist.TCPStore(addr, port, world,
                         is_master=rank == 0 and not agent, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def shutdown_rank() -> None:
    comm.clear_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
