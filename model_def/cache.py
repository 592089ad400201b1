"""The per-request memory a step reads and writes, laid out the way the runtime allocates it.

Two kinds of block, owned by the runtime (split pools or one unified arena), handed to steps:

* a **state slot** holds one request's whole KDA state: for every KDA layer the fp32 recurrent
  state [H, K, V] and the short-conv window (the last `kernel-1` inputs of q, k and v). Slot-major
  so that a checkpoint restore / snapshot is one contiguous copy.
* a **KV page** holds `page_size` tokens of MLA latent cache for every MLA layer
  ([n_mla, page_size, kv_lora_rank + rope_dim]). On a rank of a DCP group of M (`kv_shards` = M)
  a page of `page_size` tokens stores only the page_size / M positions the rank owns (p mod M = r,
  at row (p // M) % (page_size / M)): the runtime's pages count tokens, the rank's rows are fewer.

Both are views over a byte buffer so a unified arena can place them anywhere; `CacheSpec` gives
the byte sizes that `k3compile info`, the pools and the scheduler share.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 256  # byte alignment of sub-blocks inside a slot (keeps vectorized loads aligned)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class CacheSpec:
    n_kda: int
    kda_heads: int
    kda_head_k: int
    kda_head_v: int
    conv_channels: int  # q, k and v streams stacked: 3 * H * K
    conv_window: int  # kernel_size - 1 past inputs
    n_mla: int
    kv_width: int  # kv_lora_rank + qk_rope_head_dim (576 for K3)
    dtype: torch.dtype  # activation / KV dtype
    state_dtype: torch.dtype = torch.float32
    kv_shards: int = 1  # DCP group size: a page of page_size tokens holds page_size / kv_shards rows here

    @classmethod
    def from_config(cls, cfg, dtype=torch.bfloat16, tp_size: int = 1, kv_shards: int = 1) -> "CacheSpec":
        if cfg.kda_num_heads % tp_size:
            raise ValueError(f"KDA heads ({cfg.kda_num_heads}) are not divisible by TP size {tp_size}")
        if kv_shards < 1:
            raise ValueError(f"kv_shards must be >= 1, got {kv_shards}")
        h = cfg.kda_num_heads // tp_size
        return cls(n_kda=len(cfg.kda_layers), kda_heads=h, kda_head_k=cfg.kda_head_dim, kda_head_v=cfg.kda_head_dim,
                   conv_channels=3 * h * cfg.kda_head_dim, conv_window=cfg.conv_kernel_size - 1,
                   n_mla=len(cfg.mla_layers), kv_width=cfg.kv_cache_width, dtype=dtype, kv_shards=kv_shards)

    # --- sizes in bytes ---
    @property
    def ssm_bytes_per_slot(self) -> int:
        return self.n_kda * self.kda_heads * self.kda_head_k * self.kda_head_v * self.state_dtype.itemsize

    @property
    def conv_bytes_per_slot(self) -> int:
        return self.n_kda * self.conv_channels * self.conv_window * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        return _round_up(self.ssm_bytes_per_slot, _ALIGN) + _round_up(self.conv_bytes_per_slot, _ALIGN)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.n_mla * self.kv_width * self.dtype.itemsize

    def page_rows(self, page_size: int) -> int:
        """Rows a page of `page_size` tokens stores on this rank (all of them unless KV is DCP-sharded)."""
        if page_size % self.kv_shards:
            raise ValueError(f"page size {page_size} is not a multiple of the DCP size {self.kv_shards}: every "
                             f"rank of the group must store the same number of rows per page")
        return page_size // self.kv_shards

    def page_bytes(self, page_size: int) -> int:
        return _round_up(self.kv_bytes_per_token * self.page_rows(page_size), _ALIGN)


@dataclass
class CacheTensors:
    """Views the step functions index: ssm[slot, kda_layer], conv[slot, kda_layer], kv[page, mla_layer]."""
    ssm: torch.Tensor  # [num_slots, n_kda, H, K, V] fp32
    conv: torch.Tensor  # [num_slots, n_kda, 3*H*K, window]
    kv: torch.Tensor  # [num_pages, n_mla, page_size, kv_width]
    page_size: int
    slot_rows: torch.Tensor | None = None  # [num_slots, slot_bytes] uint8: whole slots as raw bytes

    @property
    def num_slots(self) -> int:
        return self.ssm.shape[0]

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @classmethod
    def allocate(cls, spec: CacheSpec, num_slots: int, num_pages: int, page_size: int,
                 device="cpu") -> "CacheTensors":
        """Split layout: one byte buffer for slots, one for pages."""
        slots = torch.zeros(num_slots * spec.slot_bytes, dtype=torch.uint8, device=device)
        pages = torch.zeros(num_pages * spec.page_bytes(page_size), dtype=torch.uint8, device=device)
        return cls.from_buffers(spec, slots, num_slots, pages, num_pages, page_size)

    @classmethod
    def from_buffers(cls, spec: CacheSpec, slot_buf: torch.Tensor, num_slots: int, page_buf: torch.Tensor,
                     num_pages: int, page_size: int) -> "CacheTensors":
        """Build the views over byte buffers (which may be two regions of one arena)."""
        sb, pb = spec.slot_bytes, spec.page_bytes(page_size)
        rows = slot_buf[: num_slots * sb].view(num_slots, sb)
        ssm_end = spec.ssm_bytes_per_slot
        conv_off = _round_up(ssm_end, _ALIGN)
        ssm = rows[:, :ssm_end].view(spec.state_dtype).view(
            num_slots, spec.n_kda, spec.kda_heads, spec.kda_head_k, spec.kda_head_v)
        conv = rows[:, conv_off: conv_off + spec.conv_bytes_per_slot].view(spec.dtype).view(
            num_slots, spec.n_kda, spec.conv_channels, spec.conv_window)
        prow = page_buf[: num_pages * pb].view(num_pages, pb)
        rows_per_page = spec.page_rows(page_size)
        kv = prow[:, : spec.kv_bytes_per_token * rows_per_page].view(spec.dtype).view(
            num_pages, spec.n_mla, rows_per_page, spec.kv_width)
        return cls(ssm=ssm, conv=conv, kv=kv, page_size=page_size, slot_rows=rows)

    def copy_slot(self, src: torch.Tensor | int, dst: torch.Tensor | int) -> None:
        """Copy whole state slots (restore / snapshot). One kernel per call on the current stream."""
        if self.slot_rows is not None:
            self.slot_rows[dst] = self.slot_rows[src]
        else:
            self.ssm[dst] = self.ssm[src]
            self.conv[dst] = self.conv[src]

    def zero_slot(self, slot: int) -> None:
        """The state before the first token: zero recurrent state and empty conv windows."""
        if self.slot_rows is not None:
            self.slot_rows[slot].zero_()
        else:
            self.ssm[slot].zero_()
            self.conv[slot].zero_()

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole KV pages src[i] -> dst[i] (a forked request's own tail)."""
        kv = self.kv
        kv.index_copy_(0, torch.tensor(dst, device=kv.device), kv.index_select(0, torch.tensor(src, device=kv.device)))
