"""One rank's step provider for the runtime: a rank engine (or an eager rank model) seen through the
runtime's token pages.

The runtime (scheduler, radix cache, pools, executor) counts pages in tokens, identically on every
rank, so one batch-metadata object is valid everywhere. Under DCP of size M a rank stores only the
positions p with p mod M == its DCP rank, at local row p // M of the request's pages
(model_def/parallel/dcp_attention.py). With a runtime page of `page_size` tokens holding
`page_size / M` rows on each rank, logical page k (positions [k*page_size, (k+1)*page_size)) is the
same page index k on every rank of the group, so the page table needs no translation; only the
flat write location of each new token does (`local_cache_loc`), and that is done here, inside the
step function, so it is captured into CUDA graphs with the rest of the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3compile.model_def.batch import MODES
from k3compile.model_def.cache import CacheSpec
from k3compile.model_def.parallel.topology import Topology, parse_topology

_OUT_CACHE_LOC = 5  # index of out_cache_loc in STEP_INPUTS
DEFAULT_PAGE_ROWS = 16


def local_cache_loc(loc: torch.Tensor, page_size: int, dcp_rank: int, dcp: int) -> torch.Tensor:
    """Token-page locations (page * page_size + p % page_size) -> this DCP rank's row locations
    (page * rows + (p % page_size) // dcp), 0 (the padding sink) for positions another rank stores."""
    if dcp == 1:
        return loc
    rows = page_size // dcp
    page, off = loc // page_size, loc % page_size
    return torch.where(off % dcp == dcp_rank, page * rows + off // dcp, torch.zeros_like(loc))


@dataclass(frozen=True)
class RankSource:
    """Where each rank's weights come from: an engine directory built with --topology, or (eager, for
    development and tests) a model preset / checkpoint cut up at start-up by `shard_model`."""
    engine_dir: str | None = None
    model: str | None = None
    topology: str | None = None  # with `model`
    experts: str = "auto"
    dtype: str = "fp32"
    seed: int = 0

    def parsed_topology(self) -> Topology:
        if self.engine_dir is not None:
            from k3compile.engine import format as fmt
            m = fmt.read_manifest(self.engine_dir)
            return parse_topology(m["topology"], m.get("experts", "auto"))
        return parse_topology(self.topology, self.experts)

    def world(self) -> int:
        return self.parsed_topology().world

    def check(self) -> None:
        """Refuse, before any rank starts, a model the topology cannot split (an engine was checked at build)."""
        if self.model is not None:
            from k3compile.model_def.loader import resolve_config
            from k3compile.model_def.parallel.topology import check_topology
            check_topology(resolve_config(self.model), self.parsed_topology())


class RankProvider:
    """The step provider of rank `rank` (what the executor runs), with the runtime's page geometry."""

    def __init__(self, base, topology: Topology, rank: int, page_rows: int):
        self.base, self.topology, self.rank = base, topology, rank
        self.config = base.config
        self.dcp_rank, self.dcp = rank % topology.dcp, topology.dcp
        self.page_size = page_rows * topology.dcp  # tokens per runtime page
        self.dtype = getattr(base, "dtype", None) or next(base.parameters()).dtype
        self.decode_buckets = getattr(base, "decode_buckets", None)
        modes = sorted(base.graphs) if isinstance(getattr(base, "graphs", None), dict) else list(MODES)
        self.graphs = {mode: self._step_fn(mode) for mode in modes}

    @property
    def device(self) -> torch.device:
        if isinstance(self.base, torch.nn.Module):
            return next(self.base.parameters()).device
        return self.base.device

    def cache_spec(self, dtype: torch.dtype | None = None) -> CacheSpec:
        return CacheSpec.from_config(self.config, dtype or self.dtype, self.topology.world, self.topology.dcp)

    def _step_fn(self, mode: str):
        base, dcp_rank, dcp = self.base, self.dcp_rank, self.dcp
        run = base.graphs[mode] if isinstance(getattr(base, "graphs", None), dict) else \
            (lambda *a: base.step_tensors(mode, *a))

        def step(*args):
            args = list(args)
            page_size = args[-1].shape[2] * dcp  # kv pool [pages, n_mla, rows, width]
            args[_OUT_CACHE_LOC] = local_cache_loc(args[_OUT_CACHE_LOC], page_size, dcp_rank, dcp)
            return run(*args)
        return step

    def step_tensors(self, mode: str, *args: torch.Tensor) -> torch.Tensor:
        if mode not in self.graphs:
            raise ValueError(f"unsupported step mode {mode!r}; this rank has {sorted(self.graphs)}")
        return self.graphs[mode](*args)


def open_rank(source: RankSource, rank: int, device) -> RankProvider:
    """Load rank `rank`'s weights and steps onto `device`."""
    if source.engine_dir is not None:
        from k3compile.engine.engine import Engine
        engine = Engine.load(source.engine_dir, device=device, rank=rank)
        return RankProvider(engine, engine.topology, rank, engine.page_size)
    from k3compile.model_def.dtypes import DTYPES
    from k3compile.model_def.loader import load_model
    from k3compile.model_def.parallel.shard import shard_model
    from k3compile.model_def.parallel.topology import RankShard

    topology = parse_topology(source.topology, source.experts)
    whole = load_model(source.model, dtype=DTYPES[source.dtype], device=device, seed=source.seed, progress=False)
    model = shard_model(whole, RankShard.of(whole.config, topology, rank))
    del whole
    return RankProvider(model, topology, rank, DEFAULT_PAGE_ROWS)
