"""The PNG of a `bench serve` result: per run of the sweep, throughput, TTFT (p50/p99) and ITL (p50/p99,
with the engine's step where measured), against concurrency (or request rate)."""
from __future__ import annotations


def plot(doc: dict, path: str) -> str | None:
    """Writes `path`; None (nothing written) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = doc["runs"]
    by_conc = len({r["request_rate"] for r in runs}) == 1
    labels = [f"c{r['max_concurrency']}" if by_conc else f"{r['request_rate']}/s c{r['max_concurrency']}"
              for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    pos = list(range(len(runs)))
    axes[0].bar(pos, [r["output_throughput"] for r in runs])
    axes[0].set_title("output throughput (tok/s)")
    for name, ax in (("ttft", axes[1]), ("itl", axes[2])):
        for q, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(pos, [r.get(f"{q}_{name}_ms", float("nan")) for r in runs], style, label=f"{name} {q}")
        ax.set_title(f"{name.upper()} (ms)")
    steps = [r.get("engine_step_ms") for r in runs]
    if any(s is not None for s in steps):
        axes[2].plot(pos, [s if s is not None else float("nan") for s in steps], "k^:", label="engine step")
    for ax in axes:
        ax.set_xticks(pos, labels)
        ax.set_xlabel("max concurrency" if by_conc else "request rate, max concurrency")
        ax.grid(alpha=0.3)
    axes[1].legend()
    axes[2].legend()
    fig.suptitle(f"bench serve: {doc['model']} ({doc['dataset']}, {doc['num_prompts']} prompts per run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":   # python -m k3compile.bench.serve_plot RESULT.json: the PNG next to it
    import json
    import sys

    for name in sys.argv[1:]:
        with open(name) as f:
            print(plot(json.load(f), name.rsplit(".", 1)[0] + ".png") or "matplotlib is not installed")
