"""Test harness for the hybrid radix cache: a tiny cache layout, a memory wrapper that accounts for
every live index, and a deterministic toy "model" whose KDA state and KV depend on the whole prefix.

Toy model. The state after tokens t_1..t_n encodes the rolling hash h_n = (31 h_{n-1} + t_n + 1) mod
M (h_0 = 0) as a fixed pattern over all ssm and conv values of the slot (all zeros for the empty prefix); the KV row of token n is a
pattern of h_n. `forward` reads h back from the working slot before it continues, so a wrong restore
(or a checkpoint holding the wrong prefix's state) shows up in every later state, snapshot and KV
row. All values stay below 2**16, so fp32 holds them exactly and equality checks are exact.
"""
from __future__ import annotations

import torch

from k3compile.model_def.cache import CacheSpec
from k3compile.runtime.cache.checks import check_cache

MOD = 65521
SPEC = CacheSpec(n_kda=2, kda_heads=1, kda_head_k=2, kda_head_v=2, conv_channels=6, conv_window=2, n_mla=1,
                 kv_width=3, dtype=torch.float32)


def prefix_hashes(tokens) -> list[int]:
    """h_1..h_n for the prefixes of `tokens`."""
    out, h = [], 0
    for t in tokens:
        h = (h * 31 + t + 1) % MOD
        out.append(h)
    return out


def prefix_hash(tokens) -> int:
    hs = prefix_hashes(tokens)
    return hs[-1] if hs else 0


def state_pattern(h: int, spec: CacheSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    n_ssm = spec.n_kda * spec.kda_heads * spec.kda_head_k * spec.kda_head_v
    n_conv = spec.n_kda * spec.conv_channels * spec.conv_window
    # h = 0 (no tokens yet) gives all zeros: the zero state a miss restores to.
    ssm = ((h * (1 + torch.arange(n_ssm))) % MOD).to(torch.float32)
    conv = ((3 * h * (1 + torch.arange(n_conv))) % MOD).to(spec.dtype)
    return (ssm.view(spec.n_kda, spec.kda_heads, spec.kda_head_k, spec.kda_head_v),
            conv.view(spec.n_kda, spec.conv_channels, spec.conv_window))


def kv_patterns(hs: list[int], spec: CacheSpec = SPEC) -> torch.Tensor:
    """[len(hs), n_mla, kv_width] KV rows for tokens whose prefix hashes are `hs`."""
    h = torch.tensor(hs, dtype=torch.int64).view(-1, 1)
    vals = (5 * h + 11 + torch.arange(spec.n_mla * spec.kv_width)) % MOD
    return vals.to(spec.dtype).view(len(hs), spec.n_mla, spec.kv_width)


def write_state(memory, slot: int, tokens) -> None:
    ssm, conv = state_pattern(prefix_hash(tokens))
    memory.tensors.ssm[slot] = ssm
    memory.tensors.conv[slot] = conv


def read_hash(memory, slot: int) -> int:
    return int(memory.tensors.ssm[slot].flatten()[0].item())


def state_matches(memory, slot: int, tokens) -> bool:
    ssm, conv = state_pattern(prefix_hash(tokens))
    return torch.equal(memory.tensors.ssm[slot], ssm) and torch.equal(memory.tensors.conv[slot], conv)


def forward(memory, working_slot: int, page_table: list[int], tokens, start: int, end: int) -> None:
    """The toy model computes tokens[start:end]: KV rows into the page table, the state in place."""
    if end <= start:
        return
    h = read_hash(memory, working_slot)  # continue from whatever the slot holds
    hs = []
    for t in tokens[start:end]:
        h = (h * 31 + t + 1) % MOD
        hs.append(h)
    p = memory.page_size
    pos = torch.arange(start, end)
    pages = torch.tensor([page_table[q // p] for q in range(start, end)])
    memory.tensors.kv[pages, :, pos % p, :] = kv_patterns(hs)
    ssm, conv = state_pattern(h)
    memory.tensors.ssm[working_slot] = ssm
    memory.tensors.conv[working_slot] = conv


def kv_matches(memory, page_table: list[int], tokens, length: int) -> bool:
    """Do the KV rows for tokens[:length] under `page_table` hold the toy model's values?"""
    if length == 0:
        return True
    p = memory.page_size
    pos = torch.arange(length)
    pages = torch.tensor([page_table[q // p] for q in range(length)])
    return torch.equal(memory.tensors.kv[pages, :, pos % p, :], kv_patterns(prefix_hashes(tokens[:length])))


class TrackingMemory:
    """Wraps a KVStateMemory and keeps the exact set of live slot and page indices (following
    relocations), so tests can account for every allocated index. `move` relocates a block on
    demand, the way a compacting arena would, also for split pools that never move anything."""

    def __init__(self, inner):
        self.inner = inner
        self.spec, self.page_size, self.tensors = inner.spec, inner.page_size, inner.tensors
        self.live_slots: set[int] = set()
        self.live_pages: set[int] = set()
        self._listeners = []
        self.moves = 0
        inner.add_relocation_listener(self._moved)

    def alloc_slot(self) -> int:
        s = self.inner.alloc_slot()
        assert s not in self.live_slots and s != 0
        self.live_slots.add(s)
        return s

    def free_slot(self, slot: int) -> None:
        assert slot in self.live_slots, f"slot {slot} freed but not live"
        self.live_slots.remove(slot)
        self.inner.free_slot(slot)

    def alloc_pages(self, n: int) -> list[int]:
        pages = self.inner.alloc_pages(n)
        assert not set(pages) & self.live_pages and 0 not in pages
        self.live_pages.update(pages)
        return pages

    def free_pages(self, pages: list[int]) -> None:
        pages = list(pages)
        assert len(set(pages)) == len(pages), f"page freed twice in one call: {pages}"
        for pg in pages:
            assert pg in self.live_pages, f"page {pg} freed but not live"
        self.live_pages.difference_update(pages)
        self.inner.free_pages(pages)

    def copy_slot(self, src: int, dst: int) -> None:
        self.inner.copy_slot(src, dst)

    def zero_slot(self, slot: int) -> None:
        self.inner.zero_slot(slot)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.inner.copy_pages(src, dst)

    def num_free_slots(self) -> int:
        return self.inner.num_free_slots()

    def num_free_pages(self) -> int:
        return self.inner.num_free_pages()

    def num_used_slots(self) -> int:
        return self.inner.num_used_slots()

    def add_relocation_listener(self, fn) -> None:
        self._listeners.append(fn)

    def _moved(self, kind: str, old: int, new: int) -> None:
        live = self.live_slots if kind == "slot" else self.live_pages
        assert old in live and new not in live, f"bad relocation {kind} {old} -> {new}"
        live.remove(old)
        live.add(new)
        self.moves += 1
        for fn in self._listeners:
            fn(kind, old, new)

    def move(self, kind: str, old: int) -> int:
        """Relocate one live block to a fresh index and tell the listeners."""
        if kind == "slot":
            new = self.inner.alloc_slot()
            self.inner.copy_slot(old, new)
        else:
            new = self.inner.alloc_pages(1)[0]
            self.tensors.kv[new] = self.tensors.kv[old]
        live = self.live_slots if kind == "slot" else self.live_pages
        live.remove(old)
        live.add(new)
        self.moves += 1
        for fn in self._listeners:
            fn(kind, old, new)
        # Freeing the old block may make an arena compact (more relocations reach _moved).
        if kind == "slot":
            self.inner.free_slot(old)
        else:
            self.inner.free_pages([old])
        return new


def make_memory(page_size: int, num_slots: int = 16, num_pages: int = 64, arena: bool = False) -> TrackingMemory:
    from k3compile.runtime.memory.pools import SplitPools
    from k3compile.runtime.memory.unified import UnifiedArena
    if arena:
        return TrackingMemory(UnifiedArena(SPEC, num_slots * SPEC.slot_bytes + num_pages * SPEC.page_bytes(page_size),
                                           page_size))
    return TrackingMemory(SplitPools(SPEC, num_slots, num_pages, page_size))


def donate_sequence(cache, memory, tokens, checkpoint: bool = True):
    """What a finished request hands over: fresh pages holding the toy KV of `tokens` and, with
    `checkpoint`, a snapshot slot holding the toy state after all of them."""
    pages = memory.alloc_pages(len(tokens) // memory.page_size)
    scratch = memory.alloc_slot()
    memory.tensors.ssm[scratch].zero_()
    forward(memory, scratch, pages, tokens, 0, len(tokens))
    if checkpoint:
        return cache.insert(tokens, pages, scratch), pages
    memory.free_slot(scratch)
    return cache.insert(tokens, pages, None), pages


def store_prefix(cache, memory, tokens):
    """Donate `tokens` with a state at their end, as a finished request does, and free the pages
    the tree did not adopt. Returns the InsertResult."""
    res, pages = donate_sequence(cache, memory, tuple(tokens))
    memory.free_pages(pages[res.length // memory.page_size:])
    return res


def has_state_at(cache, tokens) -> bool:
    """Does a lookup of `tokens` restore a state after all of them (a dry run: nothing changes)?"""
    return cache.match(tokens, touch=False).cached_len == len(tokens)


def run_random_ops(cache, memory, ops, on_match, after_op=None) -> None:
    """Drive a cache through hypothesis-drawn (op, token sequence) pairs: "store" the sequence's
    whole pages, "match" via `on_match(seq)` (which does the lookup and checks what it needs),
    "evict_states" len(seq) // 3 checkpoints, or `lock_or_evict`; `after_op()` and check_cache
    after each, and every lock released at the end."""
    p, locks = memory.page_size, []
    for op, seq in ops:
        n = len(seq) // p * p
        if op == "store" and n:
            store_prefix(cache, memory, seq[:n])
        elif op == "match":
            on_match(seq)
        elif op == "evict_states":
            cache.evict_checkpoints(len(seq) // 3)
        else:
            lock_or_evict(cache, op, seq, locks)
        if after_op is not None:
            after_op()
        check_cache(cache)
    for lk in locks:
        cache.unlock(lk)
    if after_op is not None:
        after_op()
    check_cache(cache)


def lock_or_evict(cache, op: str, seq, locks: list) -> None:
    """The random-operation tests' shared moves: "lock" the node a dry match of `seq` ends at
    (pinning its checkpoint for even lengths), "unlock" one of `locks`, "evict" len(seq) pages."""
    if op == "lock":
        nd = cache.match(seq, touch=False).node
        if nd is not cache.root:
            locks.append(cache.lock(nd, pin_checkpoint=len(seq) % 2 == 0))
    elif op == "unlock" and locks:
        cache.unlock(locks.pop(len(seq) % len(locks)))
    elif op == "evict":
        cache.evict_pages(len(seq))
