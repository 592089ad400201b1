"""A built engine: post-pass step graphs + their weights, with the model's step contract.

    engine = Engine.load("engines/mini", device="cuda")
    logits = engine.step(batch, cache)          # same contract as K3ForCausalLM.step
    spec = engine.cache_spec()                  # what the runtime allocates pools for

Loading never re-runs capture or passes: it checks the manifest's format version and every file's
sha256, imports the kernel plugins the graphs name, reads the weights, and rebuilds each graph
from its JSON (graph_io). `Engine(...)` directly wraps in-memory graphs (what `build` saves, and
what the bench uses to time a pipeline without a round trip through the disk).
"""
from __future__ import annotations

import os

import torch
import torch.fx

from k3compile.model_def.batch import ForwardBatch, step_args
from k3compile.model_def.cache import CacheSpec, CacheTensors
from k3compile.model_def.config import ConfigError, ModelConfig
from k3compile.model_def.draft_window import step_input_names
from k3compile.model_def.dtypes import DTYPE_NAMES, DTYPES  # noqa: F401  (DTYPE_NAMES re-exported for build, emit, bench)

from . import format as fmt
from .graph_io import GraphFormatError, graph_from_dict
from .plugins import import_plugins



class Engine:
    def __init__(self, config: ModelConfig, graphs: dict[str, torch.fx.GraphModule], dtype: torch.dtype,
                 page_size: int = 16, decode_buckets=fmt.DECODE_BUCKETS, manifest: dict | None = None,
                 path: str | None = None, topology=None, rank: int = 0):
        """`topology` (model_def.parallel.topology.Topology) and `rank`: this engine is one rank of a
        parallel engine; its graphs issue k3:: collectives over the process groups the caller registers."""
        if not graphs:
            raise ValueError("an engine needs at least one step graph")
        self.topology, self.rank = topology, rank
        self.config, self.graphs, self.dtype = config, graphs, dtype
        self.page_size, self.decode_buckets = page_size, tuple(decode_buckets)
        self.manifest, self.path = manifest or {}, path

    # ---- the step contract (same as K3ForCausalLM) ----
    @property
    def device(self) -> torch.device:
        for gm in self.graphs.values():
            for t in gm.buffers():
                return t.device
        return torch.device("cpu")

    @property
    def world(self) -> int:
        return 1 if self.topology is None else self.topology.world

    def cache_spec(self, dtype: torch.dtype | None = None, tp_size: int | None = None) -> CacheSpec:
        """The pools of this rank (KDA heads split over the engine's ranks)."""
        if tp_size is not None and tp_size != self.world:
            name = "single" if self.topology is None else self.topology.name
            raise ValueError(f"this engine was built for topology '{name}' ({self.world} ranks); "
                             f"tp_size {tp_size} does not match")
        return CacheSpec.from_config(self.config, dtype or self.dtype, self.world)

    @torch.no_grad()
    def step_tensors(self, mode: str, *args: torch.Tensor) -> torch.Tensor:
        if mode not in self.graphs:
            raise ValueError(f"unsupported step mode {mode!r}; this engine has {sorted(self.graphs)}")
        names = step_input_names(mode)
        if len(args) != len(names):
            raise TypeError(f"a {mode} step takes {len(names)} tensors ({', '.join(names)}), got {len(args)}")
        return self.graphs[mode](*args)

    def step(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """Run one prefill / decode step; returns logits [M, V] for `batch.logits_indices` (fp32)."""
        return self.step_tensors(batch.mode, *step_args(batch, cache))

    def prefill(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        if batch.mode != "prefill":
            raise ValueError(f"prefill() got a {batch.mode!r} batch")
        return self.step(batch, cache)

    def decode(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        if batch.mode != "decode":
            raise ValueError(f"decode() got a {batch.mode!r} batch")
        return self.step(batch, cache)

    def __repr__(self) -> str:
        where = f" from {self.path}" if self.path else ""
        dtype = DTYPE_NAMES.get(self.dtype, self.dtype)
        return f"Engine({self.config.name}, {dtype}, graphs={sorted(self.graphs)}{where})"

    # ---- loading ----
    @classmethod
    def load(cls, path: str, device=None, verify_checksums: bool = True, rank: int | None = None) -> "Engine":
        """Restore an engine directory written by `k3compile build` (see format.py for the layout).
        A parallel engine's directory holds one engine per rank: `rank` picks which one to load."""
        m = fmt.read_manifest(path)
        if "ranks" in m:
            ranks = m["ranks"]
            if rank is None:
                raise fmt.EngineError(f"{path}: a {m.get('topology')} engine of {len(ranks)} ranks; each rank process "
                                      f"loads its own (rank=0..{len(ranks) - 1}); `k3compile serve` / "
                                      f"`generate` and the runtime's LLMEngine start every rank")
            if str(rank) not in ranks:
                raise fmt.EngineError(f"{path}: no rank {rank} (ranks 0..{len(ranks) - 1})")
            return cls.load(os.path.join(path, ranks[str(rank)]), device, verify_checksums)
        if rank not in (None, 0) and "parallel" not in m:
            raise fmt.EngineError(f"{path}: a single-rank engine has no rank {rank}")
        fmt.verify_files(path, m["files"], check_hashes=verify_checksums)
        for need in (fmt.WEIGHTS, *(fmt.graph_file(mode) for mode in m["graphs"])):
            if need not in m["files"]:
                raise fmt.EngineError(f"{path}/{fmt.MANIFEST}: '{need}' is not listed in 'files'")
        model = m["model"]
        try:
            config = ModelConfig.from_hf_dict(model["hf_config"], name=model.get("name", "engine"))
        except (ConfigError, KeyError, TypeError) as e:
            raise fmt.EngineError(f"{path}/{fmt.MANIFEST}: bad model config ({e})") from None
        if m["dtype"] not in DTYPES:
            raise fmt.EngineError(f"{path}/{fmt.MANIFEST}: unknown dtype {m['dtype']!r}")
        import_plugins(m.get("kernel_plugins", []), f"{path}/{fmt.MANIFEST}")
        device = torch.device(device) if device is not None else None
        weights = _load_weights(os.path.join(path, fmt.WEIGHTS), device)
        graphs = {}
        for mode in m["graphs"]:
            rel = fmt.graph_file(mode)
            d = fmt.read_json(os.path.join(path, rel), f"the {mode} step graph")
            if isinstance(d, dict) and d.get("mode") != mode:
                raise fmt.EngineError(f"{path}/{rel}: holds a {d.get('mode')!r} graph, expected {mode!r}")
            try:
                graphs[mode] = graph_from_dict(d, weights, step_input_names(mode), device,
                                               source=f"{path}/{rel}")
            except GraphFormatError as e:
                raise fmt.EngineError(str(e)) from None
        topology, rank = None, 0
        if "parallel" in m:
            from k3compile.model_def.parallel.topology import parse_topology
            par = m["parallel"]
            topology, rank = parse_topology(par["topology"], par.get("experts", "auto")), int(par["rank"])
        return cls(config, graphs, DTYPES[m["dtype"]], page_size=int(m["page_size"]),
                   decode_buckets=m["decode_buckets"], manifest=m, path=path, topology=topology, rank=rank)


# Byte alignment of every loaded weight: what torch's own allocators give (CPU 64, CUDA more). safetensors
# packs tensors at 8-byte offsets, and on CPU a weight at an odd address takes other kernel paths
# (oneDNN / MKL), so a loaded engine computed bits that differ from the built one's.
WEIGHT_ALIGN = 64


def _load_weights(path: str, device: torch.device | None) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(path, device=str(device) if device is not None else "cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise fmt.EngineError(f"{path}: cannot read the weights ({e})") from None
    return {k: t if t.data_ptr() % WEIGHT_ALIGN == 0 else t.clone(memory_format=torch.contiguous_format)
            for k, t in weights.items()}
