"""`k3compile plan` and `k3compile info --topology`: the partitioning plan as tables.

The numbers come from model_def.parallel.plan (the rank models build and the runtime use). A GPU's
memory is split as the runtime splits it: `mem_fraction` of it holds weights + KV pages + KDA state
slots; the rest stays free for activations, graphs and the allocator.
"""
from __future__ import annotations

import re

import torch

from k3compile.info import human
from k3compile.model_def.config import ConfigError
from k3compile.model_def.parallel.plan import RankPlan, all_rank_plans, rank_plan
from k3compile.model_def.parallel.topology import Topology, TopologyError

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'141GB', '141 GiB', '1.5e11' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if m is None or m.group(2) not in _UNITS and m.group(2) is not None:
        raise ConfigError(f"cannot read a memory size from {text!r} (e.g. 141GB, 80GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def plan_topologies(gpus: int) -> list[tuple[str, Topology]]:
    """The table rows for `gpus` GPUs: TP (sliced experts), TEP (whole experts), DCP, and every TP x DCP."""
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    rows = [("TP", Topology(gpus, 1, "tp")), ("TEP", Topology(gpus, 1, "ep")), ("DCP", Topology(1, gpus, "auto"))]
    rows += [("TPxDCP", Topology(n, gpus // n, "auto")) for n in range(2, gpus) if gpus % n == 0]
    return rows


def _k(n: float) -> str:
    return human(n).replace(" ", "")


def _row(kind: str, topo: Topology, cfg, gpu_bytes: int, fraction: float, dtype) -> list[str]:
    try:
        p = rank_plan(cfg, topo, 0, dtype)
    except TopologyError as e:
        return [kind, topo.name, "-", "impossible: " + str(e).split(": ", 1)[-1]]
    c = p.capacity(gpu_bytes, fraction)
    n_calls = sum(x.count for x in p.collectives)
    if not c.fits:
        fit = [f"weights exceed {human(gpu_bytes * fraction, 'B')} by {human(-c.pool_bytes, 'B')}"]
        return [kind, topo.name, p.expert_mode, human(p.weight_bytes, "B"), *fit]
    return [kind, topo.name, p.expert_mode, human(p.weight_bytes, "B"), human(c.pool_bytes, "B"),
            _k(c.kv_tokens_local), _k(c.kv_tokens_logical), str(c.kda_slots), human(p.comm_bytes_per_token(), "B"),
            str(n_calls)]


HEADER = ["kind", "topology", "experts", "weights/rank", "KV+state pool/rank", "KV tokens/rank",
          "logical KV tokens", "KDA slots", "sent/rank/token/step", "collectives/step"]


def table(rows: list[list[str]], header=HEADER) -> str:
    ncol = max([len(header)] + [len(r) for r in rows])
    width = [max([len(header[i]) if i < len(header) else 0] + [len(r[i]) for r in rows if i < len(r)])
             for i in range(ncol)]
    line = lambda r: "  ".join(c.ljust(width[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in width[: len(header)]])] + [line(r) for r in rows])


def render_plan(cfg, gpus: int, gpu_bytes: int, fraction: float, dtype=torch.bfloat16) -> str:
    quant = cfg.expert_quant or "same dtype as the rest"
    lines = [f"plan: {cfg.name} on {gpus} GPUs of {human(gpu_bytes, 'B')} (mem fraction {fraction:g}: "
             f"{human(gpu_bytes * fraction, 'B')} for weights + KV + KDA state per GPU); weights {str(dtype)[6:]}, "
             f"routed experts {quant}",
             "  KV tokens: if the whole pool holds MLA KV; logical = per rank x DCP size (each rank stores 1/M of a "
             "context). KDA slots: if the whole pool holds KDA state (one per running request).", ""]
    rows = [_row(k, t, cfg, gpu_bytes, fraction, dtype) for k, t in plan_topologies(gpus)]
    lines.append(table(rows))
    tp, dcp = (rank_plan(cfg, Topology(gpus, 1, "auto")), rank_plan(cfg, Topology(1, gpus, "auto"))) \
        if _divides(cfg, gpus) else (None, None)
    if tp is not None:
        a, b = tp.capacity(gpu_bytes, fraction), dcp.capacity(gpu_bytes, fraction)
        lines.append("")
        if a.fits and b.fits:
            ratio = b.kv_tokens_logical / max(1, a.kv_tokens_logical)
            why = (f"; a little under x{gpus} because under DCP every rank keeps the query projections of all "
                   f"MLA heads, which leaves it a smaller pool") if ratio < gpus - 0.005 else ""
            lines.append(f"logical KV capacity: TP{gpus} {_k(a.kv_tokens_logical)} tokens -> DCP{gpus} "
                         f"{_k(b.kv_tokens_logical)} tokens (x{ratio:.3f}{why})")
        else:
            lines.append(f"logical KV capacity: the weights do not fit {gpus} x {human(gpu_bytes, 'B')}, "
                         f"so no KV fits under TP{gpus} or DCP{gpus}")
    return "\n".join(lines)


def _divides(cfg, gpus: int) -> bool:
    try:
        rank_plan(cfg, Topology(gpus, 1, "auto"))
        return True
    except TopologyError:
        return False


def render_ranks(cfg, topo: Topology, dtype=torch.bfloat16) -> str:
    plans = all_rank_plans(cfg, topo, dtype)
    span = lambda r: "-" if len(r) == 0 else f"{r.start}..{r.stop - 1}"  # noqa: E731
    rows = []
    for p in plans:
        experts = f"{span(p.experts)} whole" if p.expert_mode == "ep" else f"all, cols {span(p.expert_slice)}"
        rows.append([str(p.rank), f"({p.rank // topo.dcp},{p.rank % topo.dcp})", span(p.kda_heads),
                     span(p.mla_query_heads), span(p.mla_output_heads), experts, span(p.vocab), p.kv_positions,
                     human(p.weight_bytes, "B"), human(p.kda_slot_bytes, "B"), human(p.kv_bytes_per_token, "B")])
    header = ["rank", "(tp,dcp)", "KDA heads", "MLA query heads", "MLA out heads", "experts", "vocab",
              "KV positions", "weights", "KDA state/req", "KV/stored token"]
    coll = [[c.op, c.group, c.where, str(c.count), human(c.message_bytes, "B"),
             human(c.wire_bytes(topo.world if c.group == "world" else topo.dcp), "B")] for c in plans[0].collectives]
    out = [f"{cfg.name} as {topo.name} ({topo.world} ranks)", "", table(rows, header)]
    if coll:
        out += ["", "collectives per decode step (per token of the batch, per rank):",
                table(coll, ["op", "group", "where", "per step", "message", "sent"]),
                f"total sent per rank per token and step: {human(plans[0].comm_bytes_per_token(), 'B')}"]
    return "\n".join(out)


def plans_as_dict(plans: list[RankPlan]) -> list[dict]:
    r = lambda x: [x.start, x.stop]  # noqa: E731
    return [{"rank": p.rank, "expert_mode": p.expert_mode, "kda_heads": r(p.kda_heads),
             "mla_query_heads": r(p.mla_query_heads), "mla_output_heads": r(p.mla_output_heads),
             "experts": r(p.experts), "expert_columns": r(p.expert_slice), "vocab": r(p.vocab),
             "kv_positions": p.kv_positions, "weight_bytes": p.weight_bytes,
             "kv_bytes_per_token": p.kv_bytes_per_token, "kda_slot_bytes": p.kda_slot_bytes} for p in plans]
