"""k3compile bench cache: prefix-cache policies on a small chat + one-off trace through the real model,
without memory pressure; and the policy syntax both cache benchmarks take.

    k3compile bench cache --model k3-tiny          # results in a fresh bench_out/cache-<time>/

The same replay, rows and tables as `bench cache-pressure` (bench/cache_pressure.py, which tells
policies apart under memory pressure on traces of hundreds of requests), with defaults for a
quick check that runs k3-tiny's forward: one seeded chat trace, one generous budget.

Policies are names from runtime/cache_policy.py, optionally with overrides, e.g.
`sparse:per_path=2,handover=0` (keys: chunks, decode, handover, finish, branch, tail, per_path,
total, weight (the `valued` eviction's value_weight, a float), ttl (unused_ttl: lookups near a never-hit
checkpoint before it is dropped), max_age (unused_max_age: lookups its neighbourhood was quiet), protect (protect_reused), stale (stale_age: lookups
no lookup covered a checkpoint, hit or not, before it is dropped), short_stale / short_ttl / short_max_age (the
shorter ages for checkpoints off a reused line: radix.py "Reused lines"), root_stale (stale_age on all traffic for
never-hit root-anchored checkpoints), decay_kv (a leaf whose state decays keeps its KV),
protect_branch (KV pressure deletes branch-point leaves last), kv_weight (KV pressure's value weight, a float);
0 turns a flag off / removes a cap;
`total=0.25`, a float, caps checkpoints at that share of the state slots). Every policy must
produce the same greedy tokens (checked: `outputs_match`).
"""
from __future__ import annotations

from dataclasses import replace

_KEYS = {"chunks": "donate_chunks", "decode": "donate_decode", "handover": "donate_handover",
         "finish": "donate_finish", "branch": "branch_points", "tail": "split_prompt_tail",
         "per_path": "max_checkpoints_per_path", "total": "max_checkpoints", "weight": "value_weight",
         "ttl": "unused_ttl", "max_age": "unused_max_age",
         "protect": "protect_reused", "stale": "stale_age", "tail_new": "tail_min_new",
         "root_new": "unused_root_new_only", "protect_shared": "protect_shared_leaves",
         "short_ttl": "short_unused_ttl", "short_max_age": "short_unused_max_age", "short_stale": "short_stale_age",
         "root_stale": "root_stale_unused_global", "decay_kv": "decay_keeps_kv",
         "protect_branch": "protect_branch_leaves", "kv_weight": "kv_value_weight"}


def register(sub):
    from .cache_pressure import register as register_pressure

    return register_pressure(sub, name="cache", help="prefix-cache policies on a small chat trace through the real "
                                                     "model, no memory pressure (bench cache-pressure tells them apart)",
                             traces="chat", seeds="0", budgets_kib="65536", roots=12, duration=120.0, forward="model")


def parse_policy(text: str):
    """'sparse:per_path=2,handover=0' -> a CachePolicy (named after the text)."""
    from k3compile.runtime.cache_policy import get_policy

    name, _, rest = text.partition(":")
    policy = get_policy(name.strip())
    changes = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or key not in _KEYS:
            raise ValueError(f"policy {text!r}: expected key=value with keys {', '.join(_KEYS)}, got {item!r}")
        field = _KEYS[key]
        try:
            floats = ("value_weight", "kv_value_weight", "tail_min_new")
            v = float(val) if field in floats or (field == "max_checkpoints" and "." in val) else int(val)
        except ValueError:
            raise ValueError(f"policy {text!r}: {key} takes a number, got {val!r}") from None
        if isinstance(v, float):  # the eviction weight, a tail's new share, or total=0.25: a share of the state slots
            changes[field] = v if v or field != "tail_min_new" else None
            continue
        changes[field] = (v or None) if field.startswith(("max_", "unused_", "stale_", "short_")) else bool(v)
    return replace(policy, name=text.strip(), **changes)


def split_policies(text: str) -> list[str]:
    """Policies are separated by ';', or by ',' where the next item is a policy name (not key=value)."""
    out: list[str] = []
    for part in (p.strip() for p in text.replace(";", ",").split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    if not out:
        raise ValueError("--policies: no policy given")
    return out
