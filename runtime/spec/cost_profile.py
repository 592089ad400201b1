"""The measured target step-time surface the planner reads (profiles/<device>__<model>.json).

`k3compile profile verify` measures T(B, t): the time of one verify step of B requests with t verify
tokens each (t = 1 is a decode-sized step). The planner asks for the time of a step of B requests
with N verify tokens in all: requests' lengths differ after trimming, so N/B is read between the
measured t (linear) at the smallest measured batch >= B (steps run in batch buckets).
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass


@dataclass
class CostProfile:
    device: str
    model: str
    batch_sizes: list[int]
    verify_tokens: list[int]  # tokens per request, ascending, starting at 1
    step_ms: list[list[float]]  # [batch index][tokens index]
    meta: dict | None = None

    def __post_init__(self):
        if not self.batch_sizes or not self.verify_tokens:
            raise ValueError("cost profile: empty batch_sizes or verify_tokens")
        if sorted(self.batch_sizes) != self.batch_sizes or sorted(self.verify_tokens) != self.verify_tokens:
            raise ValueError("cost profile: batch_sizes and verify_tokens must be ascending")
        if len(self.step_ms) != len(self.batch_sizes) or any(len(r) != len(self.verify_tokens) for r in self.step_ms):
            raise ValueError(f"cost profile: step_ms must be [{len(self.batch_sizes)}][{len(self.verify_tokens)}]")
        if any(not (x > 0) for r in self.step_ms for x in r):
            raise ValueError("cost profile: step times must be positive")

    def step_time(self, batch: int, total_tokens: float) -> float:
        """Milliseconds of one step of `batch` requests verifying `total_tokens` tokens in all."""
        bi = min(bisect.bisect_left(self.batch_sizes, batch), len(self.batch_sizes) - 1)
        row, ts = self.step_ms[bi], self.verify_tokens
        t = total_tokens / max(batch, 1)
        if t <= ts[0]:
            return row[0]
        if t >= ts[-1]:  # beyond the measured range: extend the last segment's slope
            if len(ts) == 1:
                return row[-1]
            slope = (row[-1] - row[-2]) / (ts[-1] - ts[-2])
            return row[-1] + slope * (t - ts[-1])
        j = bisect.bisect_right(ts, t) - 1
        f = (t - ts[j]) / (ts[j + 1] - ts[j])
        return row[j] + f * (row[j + 1] - row[j])

    def decode_time(self, batch: int) -> float | None:
        """Milliseconds of the plain decode step of `batch` requests (`profile verify` records it in
        meta.decode_ms, one per batch size), at the same bucket step_time reads; None if not recorded."""
        ms = (self.meta or {}).get("decode_ms")
        if not ms or len(ms) != len(self.batch_sizes):
            return None
        return float(ms[min(bisect.bisect_left(self.batch_sizes, batch), len(self.batch_sizes) - 1)])

    def to_dict(self) -> dict:
        return {"device": self.device, "model": self.model, "batch_sizes": self.batch_sizes,
                "verify_tokens": self.verify_tokens, "step_ms": self.step_ms, "meta": self.meta or {}}

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        missing = [k for k in ("device", "model", "batch_sizes", "verify_tokens", "step_ms") if k not in d]
        if missing:
            raise ValueError(f"cost profile: missing {', '.join(missing)}")
        return cls(d["device"], d["model"], list(d["batch_sizes"]), list(d["verify_tokens"]),
                   [list(map(float, r)) for r in d["step_ms"]], d.get("meta"))

    @classmethod
    def load(cls, path: str) -> "CostProfile":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read cost profile {path}: {e}") from e

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


def profile_name(device: str, model: str) -> str:
    """File name of a profile: device and model, filesystem-safe."""
    safe = lambda s: "".join(c if c.isalnum() or c in "-_." else "-" for c in s)  # noqa: E731
    return f"{safe(device)}__{safe(model)}.json"
