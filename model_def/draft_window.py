"""The draft window of a verify step and the commit that keeps only the accepted prefix (spec §5.3).

A verify step (`K3ForCausalLM.step` in mode "verify" or "verify_snapshot") runs L = gamma + 1 tokens
per request without writing the KDA state slots; what it leaves behind lives here, one row per
request of the batch (row i = the batch's i-th request; the window lives from verify to commit
only). `commit(cache, window, slots, accept_lens)` then moves each request's state forward by
exactly `accept_lens[i]` tokens (1 <= n <= L: the anchor's successor counts), in place:

* mode "replay" (ReplaySSM): the window holds each position's raw recurrence inputs (k before the L2
  norm, v, the log-decay g after the gate activation, beta after the sigmoid) and the fold replays
  positions 0..n-1 into the committed state with `kda_math.kda_decode_step` -- the decode step's own
  math in its order, with the stored g (never recomputed) -- so the state equals, bit for bit, what
  decoding those tokens one by one writes from the same inputs. About K*2 + V*2 + K*4 + 4 bytes per
  position per head (bf16 k, v; fp32 g, beta).
* mode "snapshot" (the baseline): the window holds the state after every position; commit copies
  the one after position n-1 (K*V*4 bytes per position per head).

In both modes the short-conv windows roll back separately: the window stores each position's conv
inputs (q, k and v streams), and the new conv window is the last (width-1) inputs of the committed
window followed by the accepted positions' inputs -- what decode's shift would have left.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import CacheSpec, CacheTensors
from .ops import kda_math

WINDOW_MODES = {"verify": "replay", "verify_snapshot": "snapshot"}  # step mode -> window kind
VERIFY_MODES = tuple(WINDOW_MODES)
# the verify steps' inputs after the STEP_INPUTS (what DraftWindow.tensors() returns, in order)
WINDOW_INPUTS = {"verify": ("win_x", "win_k", "win_v", "win_g", "win_beta"), "verify_snapshot": ("win_x", "win_states")}


def step_input_names(mode: str) -> tuple[str, ...]:
    """The tensor inputs of a `mode` step, in order (a captured graph's placeholders)."""
    from .batch import MODES, STEP_INPUTS

    if mode in MODES:
        return STEP_INPUTS
    if mode in WINDOW_INPUTS:
        return STEP_INPUTS + WINDOW_INPUTS[mode]
    raise ValueError(f"unknown step mode {mode!r}; expected one of {MODES + VERIFY_MODES}")


@dataclass(frozen=True)
class DraftWindowSpec:
    cache: CacheSpec
    length: int  # positions per request: gamma + 1
    kind: str = "replay"  # "replay" | "snapshot"

    def __post_init__(self):
        if self.kind not in ("replay", "snapshot"):
            raise ValueError(f"draft window kind must be 'replay' or 'snapshot', got {self.kind!r}")
        if self.length < 1:
            raise ValueError(f"draft window length must be >= 1, got {self.length}")

    @property
    def step_mode(self) -> str:
        return "verify" if self.kind == "replay" else "verify_snapshot"

    def bytes_per_position_per_head(self) -> dict[str, int]:
        """Recurrent part ('state') and conv-input part ('conv') of one position of one KDA head."""
        c, a, f = self.cache, self.cache.dtype.itemsize, 4
        kk, vv = c.kda_head_k, c.kda_head_v
        state = (kk * a + vv * a + kk * f + f) if self.kind == "replay" else kk * vv * c.state_dtype.itemsize
        return {"state": state, "conv": (c.conv_channels // c.kda_heads) * a}

    def bytes_per_request(self) -> int:
        per = self.bytes_per_position_per_head()
        return (per["state"] + per["conv"]) * self.length * self.cache.kda_heads * self.cache.n_kda


@dataclass
class DraftWindow:
    spec: DraftWindowSpec
    x: torch.Tensor  # [R, n_kda, L, 3*H*K] conv inputs, activation dtype
    k: torch.Tensor | None = None  # [R, n_kda, L, H, K] replay: k after the conv, before the L2 norm
    v: torch.Tensor | None = None  # [R, n_kda, L, H, V] replay
    g: torch.Tensor | None = None  # [R, n_kda, L, H, K] fp32 replay: log-decay after the gate activation
    beta: torch.Tensor | None = None  # [R, n_kda, L, H] fp32 replay: after the sigmoid
    states: torch.Tensor | None = None  # [R, n_kda, L, H, K, V] fp32 snapshot: state after each position

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @classmethod
    def allocate(cls, spec: DraftWindowSpec, rows: int, device="cpu") -> "DraftWindow":
        c, L = spec.cache, spec.length
        n, h, kk, vv = c.n_kda, c.kda_heads, c.kda_head_k, c.kda_head_v
        x = torch.zeros(rows, n, L, c.conv_channels, dtype=c.dtype, device=device)
        if spec.kind == "snapshot":
            return cls(spec, x, states=torch.zeros(rows, n, L, h, kk, vv, dtype=c.state_dtype, device=device))
        f32 = dict(dtype=torch.float32, device=device)
        return cls(spec, x, k=torch.zeros(rows, n, L, h, kk, dtype=c.dtype, device=device),
                   v=torch.zeros(rows, n, L, h, vv, dtype=c.dtype, device=device),
                   g=torch.zeros(rows, n, L, h, kk, **f32), beta=torch.zeros(rows, n, L, h, **f32))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The verify step's inputs after the pools, in order."""
        if self.spec.kind == "snapshot":
            return (self.x, self.states)
        return (self.x, self.k, self.v, self.g, self.beta)


def check_commit(window: DraftWindow, slots, accept_lens) -> None:
    if len(slots) != len(accept_lens):
        raise ValueError(f"commit: {len(slots)} state slots but {len(accept_lens)} accept lengths")
    if len(slots) > window.rows:
        raise ValueError(f"commit: {len(slots)} requests but the draft window has {window.rows} rows")
    bad = [n for n in accept_lens if not 0 <= n <= window.spec.length]
    if bad:
        raise ValueError(f"commit: accept lengths {bad} outside [0, {window.spec.length}]")


def roll_conv(cache: CacheTensors, window: DraftWindow, slots: list[int], accept_lens: list[int]) -> None:
    """Move each request's conv windows (all KDA layers, q/k/v) forward by its accepted positions: one
    gather over [committed window ; stored inputs] and one scatter, for the whole batch."""
    w = cache.conv.shape[-1]
    b = len(slots)
    if w == 0 or b == 0:
        return
    dev = cache.conv.device
    st = torch.as_tensor(slots, device=dev)
    n = torch.as_tensor(accept_lens, device=dev)
    full = torch.cat([cache.conv[st], window.x[:b].transpose(2, 3).to(cache.conv.dtype)], -1)  # [B, n_kda, 3C, W-1+L]
    idx = (n.view(-1, 1) + torch.arange(w, device=dev)).view(b, 1, 1, w).expand(*full.shape[:3], w)
    cache.conv[st] = full.gather(-1, idx)


def commit_reference(cache: CacheTensors, window: DraftWindow, slots: list[int], accept_lens: list[int]) -> None:
    """Fold (replay) or select (snapshot) each request's accepted prefix into its state slot, in place;
    roll the conv windows. Pure torch, the reference for the fold kernel (runtime/spec/fold_kernel.py)."""
    check_commit(window, slots, accept_lens)
    if window.spec.kind == "snapshot":
        for i, (slot, n) in enumerate(zip(slots, accept_lens)):
            if n:
                cache.ssm[slot] = window.states[i, :, n - 1]
    else:
        for layer in range(cache.ssm.shape[1]):
            for t in range(max(accept_lens, default=0)):
                rows = [i for i, n in enumerate(accept_lens) if n > t]
                sel = torch.tensor(rows, device=cache.ssm.device)
                st = torch.tensor([slots[i] for i in rows], device=cache.ssm.device)
                kf = kda_math.l2norm(window.k[sel, layer, t].float())
                cache.ssm[st, layer] = kda_math.kda_decode_step(cache.ssm[st, layer], kf, window.v[sel, layer, t],
                                                                window.g[sel, layer, t], window.beta[sel, layer, t])
    roll_conv(cache, window, slots, accept_lens)
