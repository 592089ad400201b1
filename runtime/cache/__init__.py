"""Hybrid radix cache: KV pages per node plus sparse KDA state checkpoints (see radix.py)."""
from .radix import HybridRadixCache, InsertResult, Lock, MatchResult, TreeNode
from .request_table import CachedRequest, RequestTable
from .state_slots import StateSlots, TooManyStateSlotsError, restore_state, snapshot_state, zero_state
from .stats import CacheStats

__all__ = ["HybridRadixCache", "InsertResult", "Lock", "MatchResult", "TreeNode", "CachedRequest", "RequestTable",
           "StateSlots", "TooManyStateSlotsError", "restore_state", "snapshot_state", "zero_state", "CacheStats"]
