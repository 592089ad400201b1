"""Loss curves: printed as they come, written as JSON and (when matplotlib is installed) a PNG."""
from __future__ import annotations

import json
import os


class Curves:
    def __init__(self, out_dir: str, name: str, meta: dict):
        self.path_json = os.path.join(out_dir, f"{name}.json")
        self.path_png = os.path.join(out_dir, f"{name}.png")
        self.data = {"meta": meta, "train": [], "val": []}
        self.name = name

    def log(self, split: str, step: int, **values: float) -> None:
        row = {"step": step, **{k: round(float(v), 5) for k, v in values.items()}}
        self.data[split].append(row)
        print(f"[{self.name}] {split} step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in values.items()),
              flush=True)

    def save(self, extra: dict | None = None) -> str | None:
        if extra:
            self.data.update(extra)
        with open(self.path_json, "w") as f:
            json.dump(self.data, f, indent=2)
        return self._plot()

    def _plot(self) -> str | None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        keys = [k for k in self.data["train"][0] if k != "step"] if self.data["train"] else []
        cols = min(4, max(1, len(keys)))
        rows = -(-max(1, len(keys)) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
        for ax in axes.flat[len(keys):]:
            ax.axis("off")
        for ax, key in zip(axes.flat, keys):
            for split, style in (("train", "-"), ("val", "o-")):
                pts = [(r["step"], r[key]) for r in self.data[split] if key in r]
                if pts:
                    ax.plot(*zip(*pts), style, label=split, markersize=3)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.legend()
        fig.suptitle(self.name)
        fig.tight_layout()
        fig.savefig(self.path_png, dpi=80)
        plt.close(fig)
        return self.path_png
