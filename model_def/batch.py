"""The step contract between model_def and its callers (runtime, capture, engines): the step modes,
the tensors a step takes (`STEP_INPUTS`, in order) and the one batch-metadata object they come from
(`ForwardBatch`, like SGLang's ForwardBatch / nano-vllm's Context).

Tokens of all requests are packed along one axis ([N] ids); `cu_seqlens` cuts them into requests.
Host-side copies of the lengths ride along so reference code can loop without device syncs.
"""
from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field

import torch

# The step modes a model and a built engine provide.
MODES = ("decode", "prefill")
# Tensor inputs of every step, in order (what `step_tensors(mode, *inputs)` and a captured graph take).
# The pools are the last three.
STEP_INPUTS = ("input_ids", "cu_seqlens", "seq_lens", "page_table", "state_slots", "out_cache_loc",
               "logits_indices", "ssm", "conv", "kv")


@dataclass
class ForwardBatch:
    mode: str  # "prefill" | "decode" | "verify"
    input_ids: torch.Tensor  # [N] int64, packed new tokens
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    cu_seqlens: torch.Tensor  # [B+1] int32, new-token boundaries per request
    seq_lens: torch.Tensor  # [B] int32, context length after this step (prefix + new)
    page_table: torch.Tensor  # [B, max_pages] int32, KV page index per page of each request
    state_slots: torch.Tensor  # [B] int64, KDA state slot per request
    out_cache_loc: torch.Tensor  # [N] int64, flat KV row (page * page_size + offset) for each new token
    page_size: int
    logits_indices: torch.Tensor  # [M] int64, rows of the packed tokens that need logits
    # host copies (never read from the device inside a step)
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.state_slots.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(cls, mode: str, token_ids: list[list[int]], prefix_lens: list[int], page_table: list[list[int]],
              state_slots: list[int], page_size: int, device="cpu", logits: str = "last",
              max_pages: int | None = None, kv_shard: tuple[int, int] | None = None) -> "ForwardBatch":
        """Build a batch from Python lists. `logits`: "last" (one row per request) or "all".

        `kv_shard=(d, M)`: the batch of DCP rank d of M, which stores position p iff p mod M == d, at
        local row p // M of its own pages (`page_table` then lists the rank's pages); tokens it does not
        store get out_cache_loc 0, a row of the reserved padding page that nothing reads."""
        d, m = kv_shard if kv_shard is not None else (0, 1)
        if not 0 <= d < m:
            raise ValueError(f"kv_shard {kv_shard}: expected (rank, size) with 0 <= rank < size")
        b = len(token_ids)
        if not (len(prefix_lens) == len(page_table) == len(state_slots) == b):
            raise ValueError("token_ids, prefix_lens, page_table and state_slots must have one entry per request")
        ext = [len(t) for t in token_ids]
        if any(e == 0 for e in ext):
            raise ValueError("every request in a batch needs at least one new token")
        if mode == "decode" and any(e != 1 for e in ext):
            raise ValueError("decode batches take exactly one new token per request")
        seq = [p + e for p, e in zip(prefix_lens, ext)]
        for i, (s, row) in enumerate(zip(seq, page_table)):
            local = (s - d + m - 1) // m
            if len(row) * page_size < local:
                raise ValueError(f"request {i}: {len(row)} pages of {page_size} cannot hold {local} tokens")
        width = max_pages if max_pages is not None else max(1, max(len(r) for r in page_table))
        flat = array.array("i")
        for row in page_table:
            flat.extend(row[:width])
            flat.extend(itertools.repeat(0, width - min(width, len(row))))
        pt = _host_tensor(flat, torch.int32).view(b, width)
        ids, pos, loc = [], [], []
        for toks, p, row in zip(token_ids, prefix_lens, page_table):
            ids.extend(toks)
            for j in range(len(toks)):
                q = p + j
                pos.append(q)
                r = q // m
                loc.append(row[r // page_size] * page_size + r % page_size if q % m == d else 0)
        cu = [0]
        for e in ext:
            cu.append(cu[-1] + e)
        if logits == "last":
            li = [c - 1 for c in cu[1:]]
        elif logits == "all":
            li = list(range(cu[-1]))
        else:
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        on_host = torch.device(device).type == "cpu"

        def t(x, dt):
            out = _host_tensor(array.array(_ARRAY_CODES[dt], x), dt)
            return out if on_host else out.to(device)

        return cls(mode=mode, input_ids=t(ids, torch.int64), positions=t(pos, torch.int64),
                   cu_seqlens=t(cu, torch.int32), seq_lens=t(seq, torch.int32), page_table=pt.to(device),
                   state_slots=t(state_slots, torch.int64), out_cache_loc=t(loc, torch.int64), page_size=page_size,
                   logits_indices=t(li, torch.int64), seq_lens_cpu=seq, prefix_lens_cpu=list(prefix_lens),
                   extend_lens_cpu=ext)


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}
assert all(array.array(c).itemsize == torch.empty(0, dtype=dt).element_size() for dt, c in _ARRAY_CODES.items())


def _host_tensor(buf: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over a Python int array (torch.tensor on a list converts element by element,
    which was most of building a long-context batch; the array converts in C)."""
    return torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)


def step_args(batch: ForwardBatch, cache) -> tuple:
    """The STEP_INPUTS of one step: the batch's tensors, then the pools (`cache`: a CacheTensors)."""
    return (batch.input_ids, batch.cu_seqlens, batch.seq_lens, batch.page_table, batch.state_slots,
            batch.out_cache_loc, batch.logits_indices, cache.ssm, cache.conv, cache.kv)
