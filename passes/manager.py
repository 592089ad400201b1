"""The pass manager: runs a `PipelineConfig` over a captured step graph and reports what each pass did.

    report = PassManager(pipeline_from_flags("p01,p02"), verify=True, dump_dir="engine/graphs/decode") \
        .run(gm, example_inputs=verify.step_inputs(model, "decode"))

Per pass it records the match count the pass returns, node count and estimated kernel launches
(passes/launches.py) before and after, and the pass's wall time. After every pass the graph is
linted, recompiled and checked to carry fake metadata on every call node (the contract passes
keep for each other). With `verify=True` each pass's output is run against the graph before it
on the example inputs with random pool contents (passes/verify.py); a difference raises
PassVerificationError naming the pass. With `dump_dir`, the readable graph is written before the
first pass (`00_captured.py`) and after each pass (`NN_<pass>.py`, NN = position in the pipeline).

The report (`PipelineReport`) is a JSON-serializable dataclass for engine.json; `render()` gives
the table for the human-readable build report.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

from .launches import count_launches, count_nodes
from .pipeline import PipelineConfig, add_pass_arguments, pipeline_from_args, pipeline_from_flags  # noqa: F401
from .registry import get_pass
from .verify import (TOLERANCES, PassVerificationError, compare_results, graph_precision, randomized_inputs,
                     run_checked, run_graph)


# node.meta key naming the pass that created a node; captured nodes have none. Engines store it per node
# (engine/graph_io.py) so that trace reports attribute each kernel to the pass behind it.
from k3compile.capture import PASS_META  # noqa: F401  (defined in capture, below passes and engines)


class PassError(RuntimeError):
    """A pass raised, returned something that is not a match count, or left a malformed graph."""


@dataclass
class PassRecord:
    name: str
    options: dict
    matches: int
    nodes_before: int
    nodes_after: int
    launches_before: int
    launches_after: int
    seconds: float
    max_rel_err: float | None = None  # set when verified
    dump: str | None = None
    # what the pass decided beyond its match count (P8's per-GEMM choices), as it left it in
    # gm.meta["k3"]["pass_details"][name]
    details: dict | None = None


@dataclass
class PipelineReport:
    graph: str
    pipeline: dict  # PipelineConfig.to_dict()
    passes: list[PassRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # in the order but disabled
    verified: bool = False
    nodes_before: int = 0
    nodes_after: int = 0
    launches_before: int = 0
    launches_after: int = 0
    seconds: float = 0.0

    def matches(self) -> dict[str, int]:
        return {p.name: p.matches for p in self.passes}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineReport":
        d = dict(d)
        d["passes"] = [PassRecord(**p) for p in d.get("passes", [])]
        return cls(**d)

    def render(self) -> str:
        rows = [("pass", "matches", "nodes", "launches", "time", "verify")]
        for p in self.passes:
            rows.append((p.name, str(p.matches), f"{p.nodes_before} -> {p.nodes_after}",
                         f"{p.launches_before} -> {p.launches_after}", f"{p.seconds * 1e3:.0f} ms",
                         "-" if p.max_rel_err is None else f"ok ({p.max_rel_err:.1e})"))
        rows.append(("total", str(sum(p.matches for p in self.passes)), f"{self.nodes_before} -> {self.nodes_after}",
                     f"{self.launches_before} -> {self.launches_after}", f"{self.seconds * 1e3:.0f} ms", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"passes on the {self.graph} graph" + (f" (skipped: {', '.join(self.skipped)})" if self.skipped else "")]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0 or j == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def snapshot(gm: GraphModule) -> GraphModule:
    """A copy of the graph that shares the weight tensors (cheap: nothing large is copied)."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    clone = GraphModule(gm, g)
    clone.meta = copy.deepcopy(gm.meta)  # plain dicts (mode, merged-weight provenance): passes edit them
    return clone


def _code_inputs(gm: GraphModule) -> list:
    """What gm.recompile() generates gm.forward from: the graph, its code generator and each node's op, name,
    target, arguments and type."""
    return [id(gm.graph), id(gm.graph._codegen)] + [(n.op, n.name, n.target, n.args, n.kwargs, n.type)
                                                    for n in gm.graph.nodes]


def _check_graph(gm: GraphModule, name: str, compiled_from: list | None) -> list:
    """Lint the graph after pass `name` and bring gm.forward up to date with it; returns _code_inputs(gm).
    Regenerating the code costs ~0.2 CPU s per k3-tiny graph and most passes match nothing on a given graph, so
    it is skipped when the graph equals `compiled_from`, what the code was last generated from."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise PassError(f"pass {name} left a malformed graph: {e}") from e
    missing = [n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta and _returns(n)]
    if missing:
        raise PassError(f"pass {name} created nodes without meta['val'] (fake metadata later passes read): "
                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    code_inputs = _code_inputs(gm)
    try:
        unchanged = compiled_from is not None and code_inputs == compiled_from
    except RuntimeError:  # a tensor argument replaced by another compares elementwise: changed
        unchanged = False
    if not unchanged:
        gm.recompile()
    return code_inputs


class _Verifier:
    """Runs the graph after each pass and compares with its run before the pass (the previous
    pass's run, so each graph runs once)."""

    def __init__(self, gm: GraphModule, inputs, tolerance: float | None):
        self.inputs = inputs
        self.tol = tolerance if tolerance is not None else TOLERANCES.get(graph_precision(gm), 1e-5)
        self.names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.reference = run_graph(gm, inputs)

    def check(self, gm: GraphModule, pass_name: str) -> float:
        try:
            result = run_checked(gm, self.inputs)
            cmp = compare_results(result, self.reference, self.names, self.tol)
        except PassVerificationError as e:
            raise PassVerificationError(f"pass {pass_name} changed the step's results: {e}") from e
        self.reference = result
        return cmp.max_rel_err


def _returns(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or len(schema.returns) > 0


class PassManager:
    def __init__(self, config: PipelineConfig | None = None, *, verify: bool = False, dump_dir: str | None = None,
                 verify_seed: int = 0, verify_tolerance: float | None = None):
        self.config = config if config is not None else PipelineConfig.default()
        self.verify, self.dump_dir = verify, dump_dir
        self.verify_seed, self.verify_tolerance = verify_seed, verify_tolerance

    def run(self, gm: GraphModule, example_inputs=None, graph_name: str | None = None) -> PipelineReport:
        """Rewrite `gm` in place through the pipeline; returns the report (also kept in gm.meta["k3"]["passes"])."""
        self.config.validate()
        name = graph_name or gm.meta.get("k3", {}).get("mode", "step")
        report = PipelineReport(graph=name, pipeline=self.config.to_dict(), verified=self.verify,
                                nodes_before=count_nodes(gm), launches_before=count_launches(gm))
        verifier = None
        if self.verify:
            if example_inputs is None:
                raise ValueError("verify=True needs example_inputs: a valid step's inputs, e.g. "
                                 "k3compile.passes.verify.step_inputs(model, mode)")
            verifier = _Verifier(gm, randomized_inputs(example_inputs, self.verify_seed), self.verify_tolerance)
        if self.dump_dir:
            os.makedirs(self.dump_dir, exist_ok=True)
            self._dump(gm, "00_captured.py", f"{name} graph as captured")
        start = time.perf_counter()
        compiled_from = None  # the graph gm.forward was last generated from here (None: not yet in this run)
        for pos, pass_name in enumerate(self.config.order, 1):
            cfg = self.config.config(pass_name)
            if not cfg.enabled:
                report.skipped.append(pass_name)
                continue
            record, compiled_from = self._run_one(gm, pos, pass_name, cfg, verifier, compiled_from)
            report.passes.append(record)
        report.seconds = time.perf_counter() - start
        report.nodes_after, report.launches_after = count_nodes(gm), count_launches(gm)
        gm.meta.setdefault("k3", {})["passes"] = report.to_dict()
        return report

    def _run_one(self, gm, pos, pass_name, cfg, verifier, compiled_from) -> tuple[PassRecord, list]:
        spec = get_pass(pass_name)
        nodes0, launches0 = count_nodes(gm), count_launches(gm)
        existing = set(gm.graph.nodes)
        t0 = time.perf_counter()
        try:
            matches = spec.run(gm, cfg)
        except Exception as e:
            raise PassError(f"pass {pass_name} failed: {type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - t0
        if not isinstance(matches, int) or isinstance(matches, bool) or matches < 0:
            raise PassError(f"pass {pass_name} must return its match count (an int >= 0), returned {matches!r}")
        compiled_from = _check_graph(gm, pass_name, compiled_from)
        for node in gm.graph.nodes:
            if node not in existing:
                node.meta[PASS_META] = pass_name
        rec = PassRecord(pass_name, dataclasses.asdict(cfg), matches, nodes0, count_nodes(gm), launches0,
                         count_launches(gm), seconds,
                         details=gm.meta.get("k3", {}).get("pass_details", {}).pop(pass_name, None))
        if verifier is not None:
            rec.max_rel_err = verifier.check(gm, pass_name)
        if self.dump_dir:
            rec.dump = self._dump(gm, f"{pos:02d}_{pass_name}.py",
                                  f"after {pass_name}: {matches} matches, nodes {nodes0} -> {rec.nodes_after}, "
                                  f"launches {launches0} -> {rec.launches_after}")
        return rec, compiled_from

    def _dump(self, gm: GraphModule, filename: str, title: str) -> str:
        path = os.path.join(self.dump_dir, filename)
        with open(path, "w") as f:
            f.write(f"# {title}\n")
            f.write(gm.print_readable(print_output=False, include_stride=False, include_device=False))
        return path
