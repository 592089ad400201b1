"""`k3compile report A --diff B`: what changed from trace A to trace B, per step (means over steps).

Kernels that disappeared or appeared are compared by name (count per step); categories and
layers by count and time; the critical path by total and by class (negative = B is faster).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from k3compile.report.analysis import Report
from k3compile.report.categories import CATEGORIES, classify
from k3compile.report.critical_path import CLASSES


@dataclass
class Change:
    name: str
    a: float
    b: float

    @property
    def delta(self) -> float:
        return round(self.b - self.a, 3)


@dataclass
class Diff:
    a: str
    b: str
    kernels: Change
    gpu_time_us: Change
    categories_count: list[Change]
    categories_us: list[Change]
    layers_us: list[Change]
    critical_path: list[Change]            # "total" first, then per class
    disappeared: list[Change] = field(default_factory=list)   # kernel names (count per step)
    appeared: list[Change] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)


def diff(a: Report, b: Report, top: int = 20) -> Diff:
    ma, mb = a.mean, b.mean
    cats_n = [Change(c, ma["by_category"][c].count, mb["by_category"][c].count) for c in CATEGORIES]
    cats_t = [Change(c, ma["by_category"][c].time_us, mb["by_category"][c].time_us) for c in CATEGORIES]
    la = {r.layer: r.time_us for r in a.roofline.layers} if a.roofline else {}
    lb = {r.layer: r.time_us for r in b.roofline.layers} if b.roofline else {}
    order = [r.layer for r in (b.roofline.layers if b.roofline else [])]
    order += [k for k in la if k not in order]
    layers = [Change(k, la.get(k, 0.0), lb.get(k, 0.0)) for k in order]
    cpa, cpb = a.critical_path_mean, b.critical_path_mean
    cp = [Change(k, cpa.get(k, 0.0), cpb.get(k, 0.0)) for k in ("total", *CLASSES)] if cpa or cpb else []
    kernel_counts_a, kernel_counts_b = a.kernels_per_step, b.kernels_per_step
    gone = [Change(n, c, 0.0) for n, c in kernel_counts_a.items() if n not in kernel_counts_b]
    new = [Change(n, 0.0, c) for n, c in kernel_counts_b.items() if n not in kernel_counts_a]
    both = [Change(n, kernel_counts_a[n], kernel_counts_b[n]) for n in kernel_counts_a
            if n in kernel_counts_b and kernel_counts_a[n] != kernel_counts_b[n]]
    gone.sort(key=lambda c: (-c.a, c.name))
    new.sort(key=lambda c: (-c.b, c.name))
    both.sort(key=lambda c: (-abs(c.delta), c.name))
    return Diff(a.path, b.path, Change("kernels", ma.get("kernels", 0), mb.get("kernels", 0)),
                Change("GPU time us", ma.get("gpu_time_us", 0), mb.get("gpu_time_us", 0)),
                cats_n, cats_t, layers, cp, gone[:top], new[:top], both[:top])


def render_diff(d: Diff) -> str:
    from k3compile.report.render import _shorten, _table

    def rows(changes):
        return [[c.name, c.a, c.b, c.delta] for c in changes]

    out = [f"k3compile report --diff: A = {d.a}", f"                          B = {d.b}", ""]
    out += _table(["per step", "A", "B", "B - A"], rows([d.kernels, d.gpu_time_us]))
    if d.critical_path:
        out += ["", "Critical path (us per step; negative = B gained)"]
        out += _table(["", "A", "B", "B - A"], rows(d.critical_path))
    out += ["", "Kernels per step by category"]
    out += _table(["category", "A", "B", "B - A"], rows(d.categories_count))
    out += ["", "GPU time per step by category (us)"]
    out += _table(["category", "A", "B", "B - A"], rows(d.categories_us))
    if d.layers_us:
        out += ["", "GPU time per step by layer (us)"]
        out += _table(["layer", "A", "B", "B - A"], rows(d.layers_us))
    for title, changes in (("Kernels that disappeared (count per step in A)", d.disappeared),
                           ("Kernels that appeared (count per step in B)", d.appeared),
                           ("Kernels whose count changed", d.changed)):
        out += ["", title]
        out += _table(["A", "B", "category", "name"],
                      [[c.a, c.b, classify(c.name), _shorten(c.name)] for c in changes],
                      left=("category", "name")) if changes else ["(none)"]
    return "\n".join(out) + "\n"
