"""k3compile bench NAME ...: dispatches to the bench modules listed in BENCHES (one module per bench)."""
from __future__ import annotations

import importlib

# bench name -> module exposing register(subparsers) (which sets func); add new benches here
BENCHES = {
    "decode": "k3compile.bench.decode",
    "ladder": "k3compile.bench.ladder",
    "cache": "k3compile.bench.cache",
    "cache-pressure": "k3compile.bench.cache_pressure",
    "compaction": "k3compile.bench.compaction",
    "memory": "k3compile.bench.memory",
    "spec": "k3compile.bench.spec",
    "serve": "k3compile.bench.serve",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="measured benchmarks (JSON + markdown results)")
    benches = p.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    for module in BENCHES.values():
        importlib.import_module(module).register(benches)
    return p
