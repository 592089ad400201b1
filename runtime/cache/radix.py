"""Hybrid radix cache: a radix tree over token ids whose nodes hold MLA KV pages and, sparsely, a
KDA state checkpoint.

KV is append-only and can be shared by any prefix; a KDA state is overwritten every token and is
only valid at the exact position it was saved. So a node holds the KV pages of its edge and, at
some chunk-aligned boundaries, a state slot with the state after the node's last token. A hit can
go no deeper than the deepest saved state (design: DESIGN.md "Runtime pieces"; SGLang's
MambaRadixCache and Marconi in reference/runtime-anchors.md §1.4-1.5, §3).

Shape
* Edges are page-aligned: the tree keys on whole pages (children by their first page of tokens),
  a split happens only at a page boundary, and the unaligned tail of a request is never inserted.
* Checkpoints sit only at depths that are multiples of `checkpoint_interval` (a multiple of the
  page size: the scheduler's prefill chunk size).
* A node without a checkpoint is a tombstone. Internal tombstones are normal (splits, evicted
  states: KV stays and can be refilled). A leaf is never a tombstone: a leaf that loses its state
  is deleted with its KV, and so is every ancestor that becomes a tombstone leaf. The one
  exception is a tombstone leaf that a running request has locked (its children were evicted
  under it); it is deleted the moment the last lock goes. With `decay_keeps_kv` a leaf whose state
  decayed (below) keeps its KV as a *KV-only leaf* (`kv_only`): no state, so no hit ends there, but
  its KV still shows a later request where it diverges, so that one plants the branch point. KV
  pressure deletes it like any leaf (its value is zero: it saves no recompute by itself).

Matching and branch points (Marconi's branch-point admission, SGLang's mamba_branching_seqlen)
* `match` walks the KV as deep as it goes, but the usable hit ends at the deepest node on the
  path that has a checkpoint. If KV matched deeper (including a divergence in the middle of an
  edge), `branch_point` is the chunk-aligned position <= the KV match where the request's next
  prefill should end a chunk, snapshot and donate; the donation splits the edge there, so the
  next request that forks at that place restores directly.

Ownership (every page and slot has exactly one owner: the tree, a request, or the free list)
* `insert` adopts the donated pages for positions the tree did not have, frees the donated pages
  for positions it already had (the caller must switch to the returned `pages`), and leaves pages
  it did not adopt with the caller. The donated checkpoint slot always becomes the tree's: it is
  stored, or freed when the node already has one or the caps cannot make room.
* Frees inside one call are deferred to its end, when the tree's maps are consistent again: a
  unified arena relocates blocks while it frees, and its listener calls must find every index
  where the maps say it is. `free_pages(list)` is assumed to free the whole list before it moves
  anything (UnifiedArena does); slots are freed one at a time and the pending list is re-keyed.

Locks (SGLang's full_lock_ref / mamba_lock_ref)
* `lock(node)` adds one KV reference to every node from `node` up to the root (nothing on that
  path can be evicted) and, separately, pins `node`'s checkpoint so state pressure cannot free it
  before the request's copy-on-write restore is queued. Unpin early with `unpin_checkpoint`;
  `unlock` releases the rest. Counts never go negative: misuse raises.

Caps and eviction
* Per-path cap: at most `max_checkpoints_per_path` *progress* checkpoints on any root-to-leaf path.
  Branch points do not count and are never its victims: a checkpoint at a node with two or more
  children, one planted by splitting an existing edge (a request diverging from, or ending
  inside, a path the tree holds), or a fork that has since lost a path (eviction must not push a
  path over the cap by turning its branch point into a progress checkpoint; this includes a fork
  that loses a path while the global cap makes room for its own new checkpoint). A new checkpoint that would exceed the cap evicts the least
  recently used unpinned progress checkpoints above it (they become tombstones); if those are
  pinned, the new one is rejected. (Counting branch points made a forking request's own later
  checkpoints push out -- or block -- the shared-stem state it had just planted: issue 15.)
* Global cap `max_checkpoints` (a count, or a float in (0, 1): that share of the state slots the
  empty memory holds): a new checkpoint beyond it evicts the next victim (below) anywhere but
  the leaf the insert extends or splits; if none is evictable it is rejected.
* `evict_checkpoints(n)` (state pressure): unpinned checkpoints; an internal node becomes a
  tombstone, a leaf is deleted. A fork's checkpoint (a node with two or more children: live paths
  still share it) is never a victim, under either policy: the leaves below go first, and a fork
  left with one child is an ordinary checkpoint again. `evict_pages(n)` (KV pressure): unlocked
  leaves, with their checkpoints. Which ones, by `eviction`:
  - "lru": least recently used first (SGLang's MambaRadixCache).
  - "value" (Marconi's FLOP-aware eviction): candidates are scored
        utility = recency + value_weight * efficiency
    both min-max normalised over the candidates, where efficiency = the prefill FLOPs a hit here
    saves over restoring from the nearest checkpointed ancestor (RecomputeCost), divided by the
    bytes evicting it frees (the state slot, plus the leaf's own KV pages when the node goes with
    it); the lowest utility goes first. `kv_value_weight` sets the weight for KV pressure alone (0: recency
    alone; under KV pressure a leaf's bytes are mostly its KV, and the term mostly deleted short one-offs'
    tails, whose state slot is most of what they free, before their repeats came: issue 15, session 13).
  With `protect_branch_leaves` KV pressure deletes a leaf holding a planted branch point (a stem whose
  sessions are gone) only once no other unlocked leaf is left; KV-only leaves (below) always go first.

Unused checkpoints (`unused_ttl`: decay, not only pressure)
* A progress checkpoint no lookup has restored from is on probation: once `unused_ttl` lookups
  have passed its anchor -- the nearest fork above it (two or more children), or the root --
  without reaching it, it is dropped (a tombstone; a leaf is deleted with its KV), memory pressure
  or not. Branch points (forks, planted ones) and checkpoints hit once are exempt: they have shown
  reuse. The clock is the anchor's traffic, not global time, so a prompt tail waits for its own
  neighbourhood (its siblings' requests, the next level of its tree search, the next turn of its
  session) however much unrelated traffic runs meanwhile; a lookup that passes through the node
  (extends it) does not age it. A neighbourhood that goes quiet (a finished search) stops that
  clock, so a checkpoint also goes once its anchor has seen no lookup for `unused_max_age`
  lookups (counted from its store at the earliest; the root never goes quiet). Issue 15: on prompted tree-of-thought most stored prompt tails
  and ends are never hit and held most of the bytes. With `root_clock_new_only` the root's clock
  counts only lookups that matched nothing (a new prefix family): every lookup passes the root, so
  a one-off's tail or a new template's first state otherwise aged with all traffic and was gone
  before its repeat or the template's third root came (session 10).

Stale checkpoints (`stale_age`: decay of what did show reuse)
* A checkpoint whose node no lookup has covered for `stale_age` lookups (counted from its store at
  the earliest) is dropped, pressure or not, whether it was hit or is a branch point: reuse shown
  once does not keep a state forever. On prompted tree-of-thought half of the state bytes `valued`
  held were states after their last hit (issue 15, session 10: a finished problem's branch points
  and tails). A shared stem is covered by every request that goes through it, so it stays while
  its traffic lasts. With `root_clock_new_only` a checkpoint anchored at the root counts only
  lookups that matched nothing (as for `unused_ttl`): a one-off's tail waits for its repeat however
  much traffic other families send. With `root_stale_unused_global` that holds only for one that showed reuse (hit,
  or a branch point): a never-hit root-anchored checkpoint goes once `stale_age` lookups of all traffic have not
  covered it (issue 15, session 12: on prompted tree-of-thought the new-family clock hardly moves, so one-off tails
  that no repeat ever came for were held to the end of the trace, 20-28% of the state held).

KV-only leaves (`decay_keeps_kv`: a state goes, its KV stays)
* A never-hit prompt tail is mostly a carrier of KV: the next request of its tree search diverges
  inside it and plants the branch point its later siblings restore from. Without the option a leaf
  that loses its state is deleted with its KV, so a decay short enough to hold few state bytes also
  took that KV (issue 15, session 13: on seed 0's prompted tree-of-thought, unused ages of 1 instead
  of 8 cost 1.6 points of the bound, all of it KV gone). With it, a leaf whose checkpoint decays
  (`unused_ttl`, `stale_age` and their short forms) keeps its edge's KV as a KV-only leaf; state
  pressure, the caps and KV pressure delete leaves as before. A state slot is 4.2 KV pages of 16
  tokens at k3-tiny's sizes and 127 at K3's: keeping the KV of a few-hundred-token tail instead of
  its state is the cheaper way to keep the branch point findable.

Reused lines (`short_unused_ttl`, `short_unused_max_age`, `short_stale_age`: two clocks)
* With the short ages set, a checkpoint keeps the long ages above only if it continues a reused
  line -- the nearest checkpoint above it was restored from, or itself continues such a line, and is
  no branch point (judged at the store: an agent's next tool step, a session's next turn) -- or is
  anchored at the root (a one-off's tail, a new family's first state); every other one (a tree
  search's prompt tails and branch points under a shared fork) uses the short ages. Issue 15,
  session 12: short ages for all (stale 15, ttl 8, max_age 8) held a quarter of the state bytes on
  prompted tree-of-thought, whose reuse is a re-made state within a few steps, but cost the agent
  trace 2-5 points of hit rate at 64 and 16 MiB: its next step restores from the state the last one
  left, after a tool call's worth of other sessions' lookups.

* `protect_reused` ("value" only): state pressure and the global cap take checkpoints that have
  shown no reuse first (never restored from, not a branch point), and those that have (a shared
  stem hit by every new problem, a repeated prompt's tail) only when nothing else is left; among
  each group the utility decides. A stem otherwise goes by recency once the problems that used it
  are gone. KV pressure (`evict_pages`) keeps the plain utility order: protecting hit leaves there
  cost the agent trace 5.3 points of hit rate at 16 MiB on seed 0 (live sessions' newest, not yet
  hit leaves went first).

LRU touch policy: a hit refreshes only the node whose checkpoint was consumed, not the whole
matched path (SGLang PR #31643 measured multi-turn hit rate 0.61 -> 0.83 with this over refreshing
the path, which made deep checkpoints look newer than the shared prefix above them). An insert
refreshes the KV recency of the path it walked and the checkpoint recency of the node it stored
at. Time is a logical clock, so behaviour is deterministic.
"""
from __future__ import annotations

import heapq
import itertools
import operator
from dataclasses import dataclass, replace
from typing import Iterator

from k3compile.runtime.memory.base import KVStateMemory

from .recompute_cost import RecomputeCost
from .stats import CacheStats

EVICTION_POLICIES = ("lru", "value")


class TreeNode:
    """One edge: `key` (a whole number of pages of token ids) and its KV `pages`."""

    __slots__ = ("id", "key", "pages", "parent", "children", "depth", "checkpoint", "kv_lock", "ckpt_lock",
                 "last_access", "ckpt_access", "alive", "planted", "passes", "ckpt_hits", "unused_age",
                 "anchor", "anchor_seen", "passes_seen", "ckpt_born", "last_pass", "ckpt_serial", "born_new",
                 "last_pass_new", "on_line", "kv_only")

    def __init__(self, nid: int, key: tuple[int, ...], pages: list[int], parent: "TreeNode | None", depth: int):
        self.id = nid
        self.key = key
        self.pages = pages  # one KV page per page_size tokens of `key`
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # by the child's first page of tokens
        self.depth = depth  # tokens from the root to the end of this node
        self.checkpoint: int | None = None  # state slot: the KDA state after token `depth`
        self.kv_lock = 0  # locks held on this node or below
        self.ckpt_lock = 0  # locks pinning this node's checkpoint
        self.last_access = 0  # orders leaf eviction (KV pressure)
        self.ckpt_access = 0  # orders checkpoint eviction (state pressure, caps)
        self.alive = True
        self.planted = False  # a branch point for the cap without being a fork: planted by splitting an edge, or a fork that lost a path
        self.passes = 0  # lookups whose KV match covered this whole edge (the unused-checkpoint clock)
        self.ckpt_hits = 0  # lookups that restored from this node's current checkpoint
        self.unused_age = 0  # lookups that passed the anchor, not this node, since the checkpoint was stored
        self.anchor: TreeNode | None = None  # the anchor when unused_age was last brought up to date ...
        self.anchor_seen = 0  # ... its passes then
        self.passes_seen = 0  # ... and this node's
        self.ckpt_born = 0  # lookups (all of them) when the checkpoint was stored
        self.last_pass = 0  # lookups (all of them) when one last covered this edge
        self.ckpt_serial = 0  # which stored checkpoint this node holds (1, 2, ...: checkpoint listeners' key)
        self.born_new = self.last_pass_new = 0  # ckpt_born and last_pass on the root's new-family clock
        self.on_line = False  # the checkpoint extends a reused line (`short_*` ages: it keeps the long ones)
        self.kv_only = False  # a leaf kept for its KV after its state decayed (`decay_keeps_kv`)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, depth={self.depth}, edge={len(self.key)}, checkpoint={self.checkpoint}, "
                f"kv_lock={self.kv_lock}, ckpt_lock={self.ckpt_lock}, children={len(self.children)})")


class Lock:
    """What one `lock` call holds. Hand it back to `unlock` exactly once."""

    __slots__ = ("node", "pinned", "released")

    def __init__(self, node: TreeNode, pinned: bool):
        self.node, self.pinned, self.released = node, pinned, False

    def __repr__(self) -> str:
        return f"Lock(node={self.node.id}, depth={self.node.depth}, pinned={self.pinned}, released={self.released})"


@dataclass(frozen=True)
class MatchResult:
    node: TreeNode  # deepest node on the path with a checkpoint (the root if none)
    cached_len: int  # usable hit: tokens whose KV and state the request can take
    pages: list[int]  # KV pages covering cached_len (re-read with path_pages after a relocation)
    checkpoint_slot: int | None  # state after cached_len tokens; None: start from the zero state
    kv_match_len: int  # tokens whose KV matched (>= cached_len); the rest is recomputed
    branch_point: int | None  # chunk-aligned position in (cached_len, kv_match_len] to checkpoint at


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode  # node ending exactly at `length`: the caller locks it for its prefix
    length: int  # tokens of the insert the tree now holds (== len(token_ids) unless the new tail was not adopted)
    pages: list[int]  # the tree's pages for [0, length): the caller's page table must use these
    freed_pages: list[int]  # donated pages for positions the tree already had; freed, no longer the caller's
    checkpoint_stored: bool  # False: the donated slot was freed (duplicate, rejected by the caps, or none given)


def as_token_tuple(token_ids) -> tuple[int, ...]:
    if hasattr(token_ids, "tolist"):  # a 1-D tensor or array
        token_ids = token_ids.tolist()
    try:
        return tuple(map(operator.index, token_ids))  # map: no Python frame per token (long prompts)
    except TypeError:
        raise TypeError("token ids must be a flat sequence of ints (list, tuple or 1-D integer tensor)") from None


def _check_cap(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _resolve_total_cap(value: "int | float | None", memory: KVStateMemory) -> int | None:
    """The global cap as a count: an int is a count; a float in (0, 1) is that share of the state
    slots the (empty) memory holds, at least 1."""
    if isinstance(value, float):
        if not 0.0 < value < 1.0:
            raise ValueError(f"max_checkpoints as a share of the state slots must be in (0, 1), got {value!r}")
        return max(1, int(value * (memory.num_free_slots() + memory.num_used_slots())))
    _check_cap("max_checkpoints", value)
    return value


class HybridRadixCache:
    def __init__(self, memory: KVStateMemory, checkpoint_interval: int, max_checkpoints_per_path: int | None = None,
                 max_checkpoints: int | float | None = None, eviction: str = "lru", recompute_cost: RecomputeCost | None = None,
                 value_weight: float = 1.0, unused_ttl: int | None = None, unused_max_age: int | None = None,
                 protect_reused: bool = False, stale_age: int | None = None, root_clock_new_only: bool = False,
                 protect_shared_leaves: bool = False, short_unused_ttl: int | None = None,
                 short_unused_max_age: int | None = None, short_stale_age: int | None = None,
                 root_stale_unused_global: bool = False, decay_keeps_kv: bool = False,
                 protect_branch_leaves: bool = False, kv_value_weight: float | None = None):
        p = memory.page_size
        if not isinstance(checkpoint_interval, int) or checkpoint_interval < 1 or checkpoint_interval % p:
            raise ValueError(f"checkpoint_interval must be a positive multiple of the page size {p}, "
                             f"got {checkpoint_interval!r}")
        _check_cap("max_checkpoints_per_path", max_checkpoints_per_path)
        max_checkpoints = _resolve_total_cap(max_checkpoints, memory)
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        if eviction == "value" and recompute_cost is None:
            raise ValueError("eviction='value' needs a recompute_cost (RecomputeCost.from_config(model config))")
        if not value_weight >= 0:
            raise ValueError(f"value_weight must be >= 0, got {value_weight!r}")
        _check_cap("unused_ttl", unused_ttl)
        _check_cap("unused_max_age", unused_max_age)
        if unused_max_age is not None and unused_ttl is None:
            raise ValueError("unused_max_age backs up unused_ttl: set unused_ttl too")
        self.unused_ttl, self.unused_max_age = unused_ttl, unused_max_age
        _check_cap("stale_age", stale_age)
        self.stale_age = stale_age
        self.root_clock_new_only = root_clock_new_only
        self.root_stale_unused_global = root_stale_unused_global
        self.decay_keeps_kv = decay_keeps_kv
        for name, short, long in (("short_unused_ttl", short_unused_ttl, unused_ttl),
                                  ("short_unused_max_age", short_unused_max_age, unused_max_age),
                                  ("short_stale_age", short_stale_age, stale_age)):
            _check_cap(name, short)
            if short is not None and (long is None or short > long):
                raise ValueError(f"{name} shortens {name[6:]} for checkpoints off a reused line: it needs "
                                 f"{name[6:]} set and at least as long, got {short!r} against {long!r}")
        self.short_unused_ttl, self.short_unused_max_age = short_unused_ttl, short_unused_max_age
        self.short_stale_age = short_stale_age
        self._root_misses = 0  # lookups whose KV matched nothing: a new prefix family (the root's own clock)
        if protect_reused and eviction != "value":
            raise ValueError("protect_reused orders the 'value' eviction's candidates; eviction is " + repr(eviction))
        self.protect_reused = protect_reused
        if protect_shared_leaves and eviction != "value":
            raise ValueError("protect_shared_leaves orders the 'value' eviction's candidates; eviction is " + repr(eviction))
        self.protect_shared_leaves = protect_shared_leaves
        if protect_branch_leaves and eviction != "value":
            raise ValueError("protect_branch_leaves orders the 'value' eviction's candidates; eviction is "
                             + repr(eviction))
        self.protect_branch_leaves = protect_branch_leaves
        self._probation: dict[int, TreeNode] = {}  # node id -> node whose checkpoint is on probation
        self.eviction, self.recompute_cost, self.value_weight = eviction, recompute_cost, float(value_weight)
        if kv_value_weight is not None and not kv_value_weight >= 0:
            raise ValueError(f"kv_value_weight must be >= 0 or None, got {kv_value_weight!r}")
        # KV pressure's weight (None: value_weight's): 0 deletes leaves by recency alone
        self.kv_value_weight = self.value_weight if kv_value_weight is None else float(kv_value_weight)
        self.memory, self.page_size, self.checkpoint_interval = memory, p, checkpoint_interval
        self.max_checkpoints_per_path, self.max_checkpoints = max_checkpoints_per_path, max_checkpoints
        self.root = TreeNode(0, (), [], None, 0)
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._nodes: dict[int, TreeNode] = {}  # every node but the root
        self._page_loc: dict[int, tuple[TreeNode, int]] = {}  # page -> (node, index in node.pages)
        self._slot_owner: dict[int, TreeNode] = {}  # checkpoint slot -> node
        self._locks: set[Lock] = set()
        self._doomed_pages: list[int] = []  # freed at the end of the current call
        self._doomed_slots: list[int] = []
        self._stats = CacheStats()
        self._checkpoint_listeners: list = []
        memory.add_relocation_listener(self._on_relocate)

    def add_checkpoint_listener(self, fn) -> None:
        """Call `fn(event, serial)` on every checkpoint's life events: "store" when one is admitted
        (serials count stores from 1, so a state stored again after a drop is a new serial), "hit"
        when a lookup restores from it, "drop" when it leaves the tree (any eviction or decay). For
        measurements (the benchmark's oracle: which states a policy's hits needed, and when);
        nothing in the cache depends on it."""
        if not callable(fn):
            raise TypeError(f"a checkpoint listener must be callable, got {type(fn).__name__}")
        self._checkpoint_listeners.append(fn)

    def _tell(self, event: str, serial: int) -> None:
        for fn in self._checkpoint_listeners:
            fn(event, serial)

    # ------------------------------------------------------------------ queries
    def match(self, token_ids, touch: bool = True) -> MatchResult:
        """Longest usable prefix of `token_ids` (whole pages only).

        A request must compute at least one token to get logits, so the scheduler matches
        `prompt[:-1]`. `touch=False` is a dry run: no LRU refresh, no stats.
        """
        tokens = as_token_tuple(token_ids)
        if touch and self.unused_ttl is not None and self._probation:
            self._expire_unused()  # before the walk: the result describes the tree as it stays
        if touch and self.stale_age is not None and self._slot_owner:
            self._expire_stale()
        n = len(tokens) - len(tokens) % self.page_size
        path, _, kv_len = self._walk(tokens, n)
        node = self.root
        for nd in path:
            if nd.checkpoint is not None:
                node = nd
        aligned = kv_len - kv_len % self.checkpoint_interval
        branch = aligned if aligned > node.depth else None
        if touch:
            s = self._stats
            s.lookups += 1
            s.query_tokens += len(tokens)
            s.hit_tokens += node.depth
            s.kv_match_tokens += kv_len
            self.root.passes += 1
            if kv_len == 0:
                self._root_misses += 1
            for nd in path:
                nd.passes += 1
                nd.last_pass, nd.last_pass_new = s.lookups, self._root_misses
            if node is not self.root:
                node.last_access = node.ckpt_access = self._tick()
                node.ckpt_hits += 1
                self._probation.pop(node.id, None)  # reuse shown: exempt from now on
                self._tell("hit", node.ckpt_serial)
        return MatchResult(node=node, cached_len=node.depth, pages=self.path_pages(node),
                           checkpoint_slot=node.checkpoint, kv_match_len=kv_len, branch_point=branch)

    def path_pages(self, node: TreeNode) -> list[int]:
        """KV pages of the prefix that ends at `node`, in token order."""
        parts = []
        while node is not self.root:
            parts.append(node.pages)
            node = node.parent
        return list(itertools.chain.from_iterable(reversed(parts)))

    def path_tokens(self, node: TreeNode) -> tuple[int, ...]:
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        return iter(self._nodes.values())

    def num_checkpoints(self) -> int:
        return len(self._slot_owner)

    def num_pages(self) -> int:
        return len(self._page_loc)

    def evictable_pages(self) -> int:
        """Pages `evict_pages` could free now: a node with no lock has no locked node below it."""
        return sum(len(nd.pages) for nd in self._nodes.values() if not nd.kv_lock)

    def evictable_checkpoints(self) -> int:
        return sum(1 for nd in self._slot_owner.values() if self._checkpoint_evictable(nd))

    def stats(self) -> CacheStats:
        n = len(self._slot_owner)
        slot_bytes = self.memory.spec.slot_bytes
        return replace(self._stats, num_nodes=len(self._nodes), num_pages=len(self._page_loc), num_checkpoints=n,
                       checkpoint_bytes=n * slot_bytes,
                       peak_checkpoint_bytes=self._stats.peak_checkpoints * slot_bytes)

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids, pages, checkpoint_slot: int | None = None) -> InsertResult:
        """Donate the KV of `token_ids` (page-aligned) and optionally the state after all of them.

        `pages[i]` holds tokens [i*page_size, (i+1)*page_size). New KV is adopted only together
        with an admitted checkpoint at its end (a leaf without one would be a tombstone); without
        one, the tree keeps what it already had and the caller keeps the pages beyond `length`.
        """
        tokens = as_token_tuple(token_ids)
        p, n = self.page_size, len(tokens)
        if n % p:
            raise ValueError(f"insert takes whole pages: {n} tokens is not a multiple of page_size {p} "
                             f"(the unaligned tail of a request is never inserted)")
        try:
            pages = [operator.index(pg) for pg in pages]
        except TypeError:
            raise TypeError("pages must be a sequence of int page indices") from None
        if len(pages) != n // p:
            raise ValueError(f"{n} tokens need {n // p} pages of {p}, got {len(pages)}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"duplicate page indices in {pages}")
        if any(pg <= 0 for pg in pages):
            raise ValueError(f"page indices must be >= 1 (0 is the reserved padding page), got {pages}")
        if checkpoint_slot is not None:
            checkpoint_slot = operator.index(checkpoint_slot)
            if n == 0 or n % self.checkpoint_interval:
                raise ValueError(f"a checkpoint is only taken at a multiple of checkpoint_interval "
                                 f"{self.checkpoint_interval} (> 0), not after {n} tokens")
            if checkpoint_slot <= 0:
                raise ValueError(f"state slot {checkpoint_slot} is the reserved padding slot")
            if checkpoint_slot in self._slot_owner:
                raise ValueError(f"state slot {checkpoint_slot} is already a checkpoint in the tree")

        path, partial, m = self._walk(tokens, n)
        known = self.path_pages(path[-1] if path else self.root)
        if partial is not None:
            known += partial[0].pages[: partial[1] // p]
        for i, pg in enumerate(pages):  # a donated page is either the tree's own page for that place or not the tree's
            if pg in self._page_loc and not (i < len(known) and known[i] == pg):
                raise ValueError(f"page {pg} (tokens from {i * p}) already belongs to the tree at another position")

        deepest = partial[0] if partial is not None else (path[-1] if path else self.root)
        admitted, victims, branch = False, [], False
        if checkpoint_slot is not None:
            admitted, victims, branch = self._make_room(path, partial, deepest, new_leaf=n > m)

        # Shape the tree: a node ending where the walk ended (splitting an edge there) and, with an
        # admitted checkpoint, a new leaf for the tokens the tree did not have.
        end = self._split(*partial) if partial is not None else deepest
        node = end
        if admitted and n > m:
            node = self._new_leaf(end, tokens[m:], pages[m // p:])
            self._stats.inserted_tokens += n - m
        # judged before the cap's victims go: the checkpoint this one continues from may be one of them
        on_line = admitted and self._extends_reused_line(node)
        for v in victims:  # all strictly above `node`, so they stay as internal tombstones
            self._drop_checkpoint(v)
            self._stats.checkpoints_evicted += 1
        if admitted:
            node.ckpt_hits = node.unused_age = 0
            node.ckpt_born, node.born_new = self._stats.lookups, self._root_misses
            node.on_line, node.kv_only = on_line, False
            self._rebase(node)
            if self.unused_ttl is not None:
                self._probation[node.id] = node
            # Admitted as a branch point (inside an edge, or at a fork): it stays one even if making
            # room under the global cap deleted one of the fork's paths, as when a fork loses a path later.
            node.planted = branch
            node.checkpoint = checkpoint_slot
            self._slot_owner[checkpoint_slot] = node
            self._stats.checkpoints_stored += 1
            node.ckpt_serial = self._stats.checkpoints_stored
            self._stats.peak_checkpoints = max(self._stats.peak_checkpoints, len(self._slot_owner))
            self._tell("store", node.ckpt_serial)
        elif checkpoint_slot is not None:
            self._doomed_slots.append(checkpoint_slot)
        # Global-cap eviction may have emptied the subtree under `deepest`, leaving a tombstone leaf.
        self._prune(deepest)
        while not node.alive:  # the prune can reach `end` when nothing was stored there
            node = node.parent

        dups = [pg for pg, mine in zip(pages[: node.depth // p], known) if pg != mine]
        self._doomed_pages.extend(dups)
        self._stats.duplicate_pages_freed += len(dups)
        t = self._tick()
        nd = node
        while nd is not self.root:
            nd.last_access = t
            nd = nd.parent
        if admitted:
            node.ckpt_access = t
        self._flush()
        return InsertResult(node=node, length=node.depth, pages=self.path_pages(node), freed_pages=dups,
                            checkpoint_stored=admitted)

    def _make_room(self, path: list[TreeNode], partial, deepest: TreeNode,
                   new_leaf: bool) -> tuple[bool, list[TreeNode], bool]:
        """Decide whether a checkpoint may be stored at the insert's end node.

        Returns (admitted, per-path victims to tombstone once the tree is shaped, whether the
        per-path cap counted it as a branch point). Evictions for the global cap happen right away;
        a transient KV reference on `deepest` keeps their cascades from deleting anything the
        insert stands on (but not the end node's other children: a fork may lose a path here).
        """
        if new_leaf:
            above, below, own = path, 0, 1
        elif partial is not None:  # the end splits an edge: a branch point, the edge and its subtree lie below
            above, below, own = path, self._max_checkpoints_down(partial[0]), 0
        else:
            end = path[-1]
            if end.checkpoint is not None:
                self._stats.checkpoints_duplicate += 1
                return False, [], False
            above = path[:-1]
            below = max((self._max_checkpoints_down(c) for c in end.children.values()), default=0)
            own = 0 if self._is_branch(end) else 1
        held = [nd for nd in above if nd.checkpoint is not None and not self._is_branch(nd)]
        victims: list[TreeNode] = []
        if self.max_checkpoints_per_path is not None:
            excess = len(held) + own + below - self.max_checkpoints_per_path
            if excess > 0:
                free = sorted((nd for nd in held if not nd.ckpt_lock), key=lambda nd: nd.ckpt_access)
                if len(free) < excess:
                    self._stats.checkpoints_rejected += 1
                    return False, [], False
                victims = free[:excess]
        cap = self.max_checkpoints
        if cap is not None and len(self._slot_owner) - len(victims) + 1 > cap:
            # The count never exceeds the cap, so this needs room only when there are no per-path
            # victims. Any evictable checkpoint may go, ancestors included (they only become
            # tombstones); the transient reference keeps leaf deletions out of the insert's path.
            self._add_kv_refs(deepest, 1)
            try:
                while len(self._slot_owner) + 1 > cap:
                    victim = self._checkpoint_victim()
                    if victim is None:  # everything else is pinned or locked
                        self._stats.checkpoints_rejected += 1
                        return False, [], False
                    self._evict_checkpoint(victim)
            finally:
                self._add_kv_refs(deepest, -1)
        return True, victims, own == 0

    def _add_kv_refs(self, node: TreeNode, delta: int) -> None:
        while node is not self.root:
            node.kv_lock += delta
            node = node.parent

    def _prune(self, nd: TreeNode) -> None:
        """Delete `nd` (and tombstone ancestors) if it is an unlocked tombstone leaf (not a KV-only leaf)."""
        if nd is not self.root and nd.alive and nd.is_leaf and nd.checkpoint is None and not nd.kv_lock \
                and not nd.kv_only:
            self._delete_upward(nd)

    @staticmethod
    def _paths(nd: TreeNode) -> int:
        """Children that continue a live path: a state or a request's lock somewhere in their subtree. A
        subtree of KV only (`decay_keeps_kv`'s KV-only leaves and tombstones over them) records where
        requests diverged, but no later request can restore below the fork from it."""
        return sum(1 for c in nd.children.values() if HybridRadixCache._holds_path(c))

    @staticmethod
    def _holds_path(nd: TreeNode) -> bool:
        stack = [nd]
        while stack:
            x = stack.pop()
            if x.checkpoint is not None or x.kv_lock or (not x.children and not x.kv_only):
                return True  # (a tombstone leaf that is no KV-only leaf is a locked one: a request's)
            stack.extend(x.children.values())
        return False

    @staticmethod
    def _is_branch(nd: TreeNode) -> bool:
        """A branch point for the per-path cap: a fork, or a checkpoint planted by splitting an edge."""
        return nd.planted or HybridRadixCache._is_fork(nd)

    @staticmethod
    def _is_fork(nd: TreeNode) -> bool:
        """Two or more live paths continue from this node (eviction keeps its checkpoint longest)."""
        if len(nd.children) < 2:
            return False
        live = 0
        for c in nd.children.values():  # stop at the second live path (this runs for every eviction candidate)
            live += HybridRadixCache._holds_path(c)
            if live >= 2:
                return True
        return False

    def _max_checkpoints_down(self, node: TreeNode) -> int:
        """Most progress checkpoints (branch points excluded) on any path from `node` (included) to a leaf."""
        best, stack = 0, [(node, 0)]
        while stack:
            nd, above = stack.pop()
            count = above + (nd.checkpoint is not None and not self._is_branch(nd))
            best = max(best, count)
            stack.extend((c, count) for c in nd.children.values())
        return best

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode, pin_checkpoint: bool = True) -> Lock:
        if not node.alive or (node is not self.root and self._nodes.get(node.id) is not node):
            raise ValueError(f"cannot lock {node!r}: it is not in this cache (evicted?)")
        self._add_kv_refs(node, 1)
        pinned = pin_checkpoint and node.checkpoint is not None
        if pinned:
            node.ckpt_lock += 1
        lk = Lock(node, pinned)
        self._locks.add(lk)
        return lk

    def unpin_checkpoint(self, lock: Lock) -> None:
        """Drop the checkpoint pin early (e.g. once the restore copy is queued); the KV stays locked."""
        self._check_lock(lock)
        if not lock.pinned:
            raise ValueError(f"{lock!r} does not pin a checkpoint")
        if lock.node.ckpt_lock <= 0:
            raise RuntimeError(f"checkpoint ref count of {lock.node!r} would go negative")
        lock.node.ckpt_lock -= 1
        lock.pinned = False

    def unlock(self, lock: Lock) -> None:
        self._check_lock(lock)
        path = []
        nd = lock.node
        while nd is not self.root:
            if nd.kv_lock <= 0:  # checked before anything changes
                raise RuntimeError(f"KV ref count of {nd!r} would go negative")
            path.append(nd)
            nd = nd.parent
        if lock.pinned:
            self.unpin_checkpoint(lock)
        for nd in path:
            nd.kv_lock -= 1
        lock.released = True
        self._locks.discard(lock)
        self._prune(lock.node)  # a tombstone leaf that only this lock kept
        self._flush()

    def _check_lock(self, lock: Lock) -> None:
        if not isinstance(lock, Lock):
            raise TypeError(f"expected a Lock from HybridRadixCache.lock, got {type(lock).__name__}")
        if lock.released or lock not in self._locks:
            raise ValueError(f"{lock!r} was already released or is not from this cache")

    # ------------------------------------------------------------------ eviction
    def evict_pages(self, num_pages: int) -> int:
        """KV pressure: delete LRU unlocked leaves until `num_pages` pages are freed (KV-only leaves first:
        they hold no state, so no lookup restores from them). Returns pages freed."""
        self._check_count(num_pages)
        if self.eviction == "value":
            freed = 0
            while freed < num_pages:
                leaves = [nd for nd in self._nodes.values() if nd.is_leaf and not nd.kv_lock]
                if not leaves:
                    break
                leaves = [nd for nd in leaves if nd.kv_only] or leaves
                if self.protect_shared_leaves or self.protect_branch_leaves:
                    leaves = [nd for nd in leaves if not self._shared_leaf(nd)] or leaves
                freed += self._delete_upward(self._lowest_utility(leaves, "last_access", self.kv_value_weight))[1]
            self._flush()
            return freed
        heap = [(not nd.kv_only, nd.last_access, nd.id, nd) for nd in self._nodes.values()
                if nd.is_leaf and not nd.kv_lock]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            *_, nd = heapq.heappop(heap)
            if not nd.alive or not nd.is_leaf or nd.kv_lock:
                continue
            survivor, pages = self._delete_upward(nd)
            freed += pages
            if survivor is not self.root and survivor.is_leaf and not survivor.kv_lock:
                heapq.heappush(heap, (not survivor.kv_only, survivor.last_access, survivor.id, survivor))
        self._flush()
        return freed

    def _shared_leaf(self, nd: TreeNode) -> bool:
        """KV pressure deletes these leaves last: restored from twice or more (`protect_shared_leaves`), or
        a branch point a second request planted or whose fork lost its paths (`protect_branch_leaves`: a
        shared stem whose sessions are gone, before the next session comes to restore from it)."""
        return (self.protect_shared_leaves and nd.ckpt_hits >= 2) or \
            (self.protect_branch_leaves and nd.checkpoint is not None and nd.planted)

    def evict_checkpoints(self, num_checkpoints: int) -> int:
        """State pressure: free unpinned checkpoints, never a fork's while anything else can go
        (`_checkpoint_victim`). Returns slots freed."""
        self._check_count(num_checkpoints)
        freed = 0
        while freed < num_checkpoints:
            victim = self._checkpoint_victim()
            if victim is None:
                break
            self._evict_checkpoint(victim)
            freed += 1
        self._flush()
        return freed

    @staticmethod
    def _check_count(n) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number to evict must be a non-negative int, got {n!r}")

    @staticmethod
    def _checkpoint_evictable(nd: TreeNode) -> bool:
        # A locked leaf would become a tombstone leaf that cannot be deleted: keep its state.
        return not nd.ckpt_lock and (bool(nd.children) or not nd.kv_lock)

    def _checkpoint_victim(self) -> TreeNode | None:
        """The checkpoint state pressure or the global cap gives up next (None: nothing evictable)."""
        candidates = [nd for nd in self._slot_owner.values() if self._checkpoint_evictable(nd)]
        if not candidates:
            return None
        candidates = [nd for nd in candidates if not self._is_fork(nd)]  # shared by live paths: leaves go first
        if not candidates:
            return None
        if self.eviction == "lru":
            return min(candidates, key=lambda nd: (nd.ckpt_access, nd.id))
        return self._lowest_utility(self._unproven_first(candidates), "ckpt_access")

    def reuse_shown(self, nd: TreeNode) -> bool:
        """Has `nd`'s checkpoint shown reuse: restored from by a lookup, or a branch point?"""
        return nd.checkpoint is not None and (nd.ckpt_hits > 0 or self._is_branch(nd))

    def _unproven_first(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """`protect_reused` (state pressure): the candidates whose checkpoint has shown no reuse, while there are any."""
        if not self.protect_reused:
            return nodes
        return [nd for nd in nodes if not self.reuse_shown(nd)] or nodes

    def checkpoint_efficiency(self, nd: TreeNode) -> float:
        """Prefill FLOPs a hit at `nd` saves over the nearest checkpointed ancestor, per byte that
        evicting it frees (its slot, plus its KV when it is a leaf and goes with it)."""
        anc = nd.parent
        while anc is not self.root and anc.checkpoint is None:
            anc = anc.parent
        freed = self.memory.spec.slot_bytes
        if nd.is_leaf:
            freed += len(nd.pages) * self.memory.spec.page_bytes(self.page_size)
        return self.recompute_cost.prefill(anc.depth, nd.depth) / freed

    def _lowest_utility(self, nodes: list[TreeNode], clock: str, weight: float | None = None) -> TreeNode:
        """Marconi's utility: recency + weight * efficiency (weight: value_weight unless given), each min-max
        normalised over `nodes`."""
        weight = self.value_weight if weight is None else weight
        rec = [getattr(nd, clock) for nd in nodes]
        eff = [self.checkpoint_efficiency(nd) if nd.checkpoint is not None else 0.0 for nd in nodes]

        def norm(xs):
            lo, hi = min(xs), max(xs)
            return [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in xs]

        util = [r + weight * e for r, e in zip(norm(rec), norm(eff))]
        return min(zip(util, (nd.id for nd in nodes), nodes))[2]

    def _evict_checkpoint(self, nd: TreeNode, decayed: bool = False) -> None:
        """Free `nd`'s state: an internal node becomes a tombstone, a leaf is deleted with its KV --
        unless the state `decayed` (no pressure) and `decay_keeps_kv`: then the leaf stays, KV only."""
        if nd.children:
            self._drop_checkpoint(nd)  # internal: becomes a tombstone, KV stays
            self._stats.checkpoints_evicted += 1
        elif decayed and self.decay_keeps_kv:
            parent = nd.parent
            if parent.checkpoint is not None and self._is_fork(parent):
                parent.planted = True  # a fork losing a live path stays a branch point for the per-path cap
            self._drop_checkpoint(nd)
            nd.kv_only, nd.ckpt_hits = True, 0
            self._stats.checkpoints_evicted += 1
        else:
            self._delete_upward(nd)  # a leaf losing its state is deleted (counted there)

    def _anchor(self, nd: TreeNode) -> TreeNode:
        """The nearest fork above `nd` (two or more children), or the root: whose traffic ages `nd`."""
        a = nd.parent
        while a is not self.root and not self._is_fork(a):
            a = a.parent
        return a

    def _extends_reused_line(self, nd: TreeNode) -> bool:
        """Reused lines (the `short_*` ages): the nearest checkpoint above `nd` was restored from, or
        itself extends such a line, and is no branch point -- `nd` continues a line some request
        already continued from (an agent's next tool step, a session's next turn), not a sibling
        under a shared fork (a tree search's prompt tail). Judged once, at the store."""
        a = nd.parent
        while a is not None and a is not self.root and a.checkpoint is None:
            a = a.parent
        return a is not None and a is not self.root and not self._is_branch(a) and (a.ckpt_hits > 0 or a.on_line)

    def _ages(self, nd: TreeNode, anchor: TreeNode | None = None) -> tuple[int | None, int | None, int | None]:
        """(unused_ttl, unused_max_age, stale_age) for `nd`'s checkpoint: the short ones (where set)
        unless it extends a reused line or is anchored at the root (a one-off's tail waiting for its
        repeat: on seed 0's tot_fork the short ages lost one of three repeats at 64 and 16 MiB).
        anchor: `nd`'s anchor when the caller has it already."""
        if nd.on_line or (anchor or self._anchor(nd)) is self.root:
            return self.unused_ttl, self.unused_max_age, self.stale_age
        return (self.short_unused_ttl or self.unused_ttl, self.short_unused_max_age or self.unused_max_age,
                self.short_stale_age or self.stale_age)

    def _anchor_clock(self, a: TreeNode) -> int:
        """Lookups that age the checkpoints anchored at `a`: those passing it, or for the root with
        `root_clock_new_only`, those that matched nothing (a new prefix family). Every lookup passes
        the root, so with that plain clock a one-off's tail or a new template's first state ages with
        all traffic, and a repeat or the template's third root can come too late."""
        return self._root_misses if a is self.root and self.root_clock_new_only else a.passes

    def _rebase(self, nd: TreeNode) -> None:
        nd.anchor = a = self._anchor(nd)
        nd.anchor_seen, nd.passes_seen = self._anchor_clock(a), nd.passes

    def _expire_unused(self) -> None:
        """Bring every probation checkpoint's unused age up to date (the lookups its anchor saw
        since the last sweep, less those that reached it; when the anchor changed -- a fork
        planted below it or gone -- the count goes on from the new one, adding nothing this
        sweep) and drop those over `unused_ttl` or whose anchor has been quiet over
        `unused_max_age` lookups (the root never is). All are judged first, then dropped, so the
        siblings of one dead fork go together. A pinned one, or a locked leaf's, stays until it
        can go. Runs before every lookup, so it misses at most the one lookup an anchor change
        falls in."""
        now, due = self._stats.lookups, []
        for nid, nd in list(self._probation.items()):
            if not nd.alive or nd.checkpoint is None or self._is_branch(nd):  # gone, or a branch point: exempt
                del self._probation[nid]
                continue
            a = self._anchor(nd)
            if a is nd.anchor:
                # a lookup reaching the node passed the anchor too -- except on the root's new-only clock
                reached = 0 if a is self.root and self.root_clock_new_only else nd.passes - nd.passes_seen
                nd.unused_age += max(0, (self._anchor_clock(a) - nd.anchor_seen) - reached)
            self._rebase(nd)
            quiet = now - max(nd.ckpt_born, now if a is self.root else a.last_pass)
            ttl, max_age, _ = self._ages(nd, a)
            if nd.unused_age > ttl or (max_age is not None and quiet > max_age):
                due.append(nd)
        for nd in due:
            if nd.alive and nd.checkpoint is not None and self._checkpoint_evictable(nd):
                self._evict_checkpoint(nd, decayed=True)
                self._stats.checkpoints_expired += 1
        self._flush()

    def _expire_stale(self) -> None:
        """`stale_age`: drop every checkpoint -- hit ones and branch points too -- whose node no
        lookup has covered (passed through or restored from) for more than `stale_age` lookups
        since its store: its neighbourhood is done (a finished search's branch points, a session's
        old turn ends), whatever reuse it showed before. The deepest go first, so a fork loses its
        paths before its own state, and a fork that still has two paths stays (no branch point goes
        while live paths below it share it). A pinned one, or a locked leaf's, stays until it can go."""
        now, new = self._stats.lookups, self._root_misses

        def young_on_root_clock(nd, limit):  # anchored at the root with root_clock_new_only: new-family lookups only
            # (with root_stale_unused_global, only for one that showed reuse: a never-hit one goes on all traffic)
            return self.root_clock_new_only and self._anchor(nd) is self.root and \
                not (self.root_stale_unused_global and not self.reuse_shown(nd)) and \
                new - max(nd.born_new, nd.last_pass_new) <= limit

        # (the new-family clock never runs ahead of the global one: check it only for the globally stale; the
        # shortest limit first, so a checkpoint's anchor is looked up only once it is that old)
        shortest = self.short_stale_age or self.stale_age
        due = [nd for nd in self._slot_owner.values()
               if (age := now - max(nd.ckpt_born, nd.last_pass)) > shortest
               and age > (limit := self._ages(nd)[2]) and not young_on_root_clock(nd, limit)]
        for nd in sorted(due, key=lambda nd: (-nd.depth, nd.id)):
            # a fork whose paths are not all gone stays (one stored after it can be younger)
            if nd.alive and nd.checkpoint is not None and self._checkpoint_evictable(nd) and not self._is_fork(nd):
                self._evict_checkpoint(nd, decayed=True)
                self._stats.checkpoints_stale += 1
        self._flush()

    # ------------------------------------------------------------------ tree surgery
    def _walk(self, tokens: tuple[int, ...], n: int):
        """Follow tokens[:n] (n page-aligned) down the tree.

        Returns (nodes matched whole, (node, tokens matched on it) for an edge matched part-way or
        None, tokens matched).
        """
        p = self.page_size
        node, pos, path = self.root, 0, []
        while pos < n:
            child = node.children.get(tokens[pos:pos + p])
            if child is None:
                break
            key, limit, i = child.key, min(len(child.key), n - pos), p  # first page matched by the dict
            # whole pages only (limit is page-aligned); slices compare in C (edges run to thousands of tokens)
            if key[i:limit] == tokens[pos + i:pos + limit]:
                i = limit
            else:
                while i < limit and key[i:i + p] == tokens[pos + i:pos + i + p]:
                    i += p
            pos += i
            if i < len(key):
                return path, (child, i), pos
            path.append(child)
            node = child
        return path, None, pos

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node`'s edge after k tokens; the new upper part is returned. `node` keeps its
        identity (and its checkpoint and pins), so locks on it stay valid."""
        p, parent = self.page_size, node.parent
        top = TreeNode(next(self._ids), node.key[:k], node.pages[: k // p], parent, parent.depth + k)
        top.kv_lock = node.kv_lock  # every lock through node passes through top
        top.last_access = node.last_access
        top.passes = node.passes  # every lookup that covered node's whole edge covered top's
        top.last_pass, top.last_pass_new = node.last_pass, node.last_pass_new
        parent.children[top.key[:p]] = top
        node.key, node.pages, node.parent = node.key[k:], node.pages[k // p:], top
        top.children[node.key[:p]] = node
        for i, pg in enumerate(top.pages):
            self._page_loc[pg] = (top, i)
        for i, pg in enumerate(node.pages):
            self._page_loc[pg] = (node, i)
        self._nodes[top.id] = top
        return top

    def _new_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        leaf = TreeNode(next(self._ids), key, list(pages), parent, parent.depth + len(key))
        parent.children[key[: self.page_size]] = leaf
        for i, pg in enumerate(leaf.pages):
            self._page_loc[pg] = (leaf, i)
        self._nodes[leaf.id] = leaf
        return leaf

    def _drop_checkpoint(self, nd: TreeNode) -> None:
        self._tell("drop", nd.ckpt_serial)
        self._probation.pop(nd.id, None)
        del self._slot_owner[nd.checkpoint]
        self._doomed_slots.append(nd.checkpoint)
        nd.checkpoint, nd.planted = None, False

    def _delete_upward(self, nd: TreeNode) -> tuple[TreeNode, int]:
        """Delete leaf `nd`, then every ancestor left as an unlocked tombstone leaf.
        Returns (the first surviving ancestor, pages freed)."""
        freed = 0
        while True:
            assert nd.is_leaf and not nd.kv_lock and not nd.ckpt_lock, f"deleting a node in use: {nd!r}"
            parent = nd.parent
            if len(parent.children) >= 2 and parent.checkpoint is not None:
                parent.planted = True  # stays a branch point for the per-path cap when its fork goes
            del parent.children[nd.key[: self.page_size]]
            for pg in nd.pages:
                del self._page_loc[pg]
            self._doomed_pages.extend(nd.pages)
            freed += len(nd.pages)
            if nd.checkpoint is not None:
                self._drop_checkpoint(nd)
                self._stats.checkpoints_evicted += 1
            del self._nodes[nd.id]
            nd.alive = False
            self._stats.nodes_evicted += 1
            self._stats.pages_evicted += len(nd.pages)
            nd = parent
            if nd is self.root or nd.children or nd.checkpoint is not None or nd.kv_lock:
                return nd, freed

    def _flush(self) -> None:
        """Return what this call freed to memory, now that the maps are consistent."""
        if self._doomed_pages:
            pages, self._doomed_pages = self._doomed_pages, []
            self.memory.free_pages(pages)
        while self._doomed_slots:
            self.memory.free_slot(self._doomed_slots.pop())  # may relocate the others: see _on_relocate

    def _on_relocate(self, kind: str, old: int, new: int) -> None:
        if kind == "page":
            loc = self._page_loc.pop(old, None)
            if loc is not None:
                loc[0].pages[loc[1]] = new
                self._page_loc[new] = loc
            elif old in self._doomed_pages:
                self._doomed_pages[self._doomed_pages.index(old)] = new
        elif kind == "slot":
            node = self._slot_owner.pop(old, None)
            if node is not None:
                node.checkpoint = new
                self._slot_owner[new] = node
            elif old in self._doomed_slots:
                self._doomed_slots[self._doomed_slots.index(old)] = new
        else:
            raise ValueError(f"relocation kind must be 'page' or 'slot', got {kind!r}")

    def _tick(self) -> int:
        return next(self._clock)
