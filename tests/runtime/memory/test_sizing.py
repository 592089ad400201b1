"""Pools sized from the device when no byte budget is given (runtime/memory/sizing.py)."""
import pytest
import torch

from k3compile.runtime.memory import sizing
from k3compile.runtime.memory.sizing import CPU_MAX_POOL_BYTES, pool_budget

GIB = 1 << 30


def test_explicit_bytes_win():
    assert pool_budget("cpu", 0.5, 12345).bytes == 12345


def test_cpu_takes_a_share_of_available_ram(monkeypatch):
    monkeypatch.setattr(sizing, "available_ram_bytes", lambda: 100 << 20)
    b = pool_budget("cpu", 0.5)
    assert b.bytes == 50 << 20 and "available RAM" in b.source
    monkeypatch.setattr(sizing, "available_ram_bytes", lambda: 64 * GIB)
    assert pool_budget("cpu").bytes == CPU_MAX_POOL_BYTES
    monkeypatch.setattr(sizing, "available_ram_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match="no room"):
        pool_budget("cpu")


def test_cuda_leaves_the_reserve_free(monkeypatch):
    """SGLang's rule: free after the weights, less (1 - fraction) of the total."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    b = pool_budget("cuda:0", 0.85)
    assert b.bytes == int(100 * GIB - 0.15 * 140 * GIB) and "mem_fraction_static 0.85" in b.source
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 140 * GIB))
    with pytest.raises(ValueError, match="raise mem_fraction_static"):
        pool_budget("cuda:0", 0.85)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1])
def test_bad_fractions_are_refused(bad):
    with pytest.raises(ValueError, match="mem_fraction_static must be in"):
        pool_budget("cpu", bad)


@pytest.mark.parametrize("unified", [None, False])
def test_engine_sizes_its_pools_and_says_so(monkeypatch, unified):
    from k3compile.runtime.engine import EngineArgs, LLMEngine

    monkeypatch.setattr(sizing, "available_ram_bytes", lambda: 40 << 20)
    engine = LLMEngine(EngineArgs(model="k3-tiny", mem_fraction_static=0.5, enable_unified_memory=unified))
    assert engine.budget.bytes == 20 << 20
    summary = engine.memory_summary()
    assert "20 MiB" in summary and "tokens of KV" in summary and "state slots" in summary
    mem = engine.memory
    if unified is None:  # the default: one arena, which pages and slots both count whole
        assert "one unified arena" in summary
        pool_bytes = mem.inner.arena_bytes
    else:
        assert "split pools" in summary
        pool_bytes = (mem.num_free_pages() + mem.num_used_pages()) * mem.spec.page_bytes(16) + \
            (mem.num_free_slots() + mem.num_used_slots()) * mem.spec.slot_bytes
    assert 0.9 * (20 << 20) <= pool_bytes <= 20 << 20
    engine.close()
