"""The paged KV cache's host bookkeeping: the page free list and the per-slot page table."""
import numpy as np
import pytest

from sfrrl_jax.engine.pages import (PageAllocator, PagesExhausted, PageTable, Paging, check_paging, pages_for,
                                   pool_units)


def test_allocator_hands_out_lowest_first_and_refuses_double_free_and_exhaustion():
    a = PageAllocator(4)
    assert a.alloc(2) == [0, 1] and a.free_count == 2 and a.used_count == 2
    with pytest.raises(PagesExhausted, match="3 pages requested, 2 of 4 free"):
        a.alloc(3)
    assert a.free_count == 2  # a refused allocation takes nothing
    a.free([1])
    with pytest.raises(ValueError, match="page 1 freed twice"):
        a.free([1])
    with pytest.raises(ValueError, match="page 0 freed twice"):
        a.free([0, 0])  # a duplicate within one call
    assert a.free_count == 3  # ... and frees nothing of that call
    with pytest.raises(ValueError, match="page 7 is not in this pool"):
        a.free([7])
    assert a.alloc(3) == [1, 2, 3]
    a.free([0, 1, 2, 3])
    assert a.free_count == 4 and a.alloc(0) == []
    with pytest.raises(ValueError, match="num_pages must be an int >= 1"):
        PageAllocator(0)


def test_page_table_grows_slots_all_or_nothing_and_release_points_at_scratch():
    t = PageTable(max_slots=3, max_len=20, page_size=4, num_pages=6)
    assert t.pages_per_slot == 5 and t.scratch.tolist() == [6]
    assert t.ensure(0, 5) and t.table[0, 0].tolist() == [0, 1, 6, 6, 6]
    v = t.version
    assert t.ensure(0, 8) and t.version == v  # 8 tokens fit in the 2 pages it has
    assert t.needed(1, 100) == 5  # capped at max_len
    assert not t.ensure_many({1: 12, 2: 8})  # 3 + 2 > 4 free: nothing taken
    assert t.free_count == 4 and (t.table[1:] == 6).all()
    assert t.ensure_many({1: 12, 2: 1})
    assert t.table[1, 0, :3].tolist() == [2, 3, 4] and t.table[2, 0, 0] == 5 and t.free_count == 0
    t.release(1)
    assert (t.table[1] == 6).all() and t.free_count == 3 and t.owned[1].tolist() == [0]
    t.release(1)  # nothing held: a no-op
    for s in range(3):
        t.release(s)
    assert t.free_count == 6


def test_paging_arguments_are_validated_by_name():
    assert check_paging(None, None, 64, 4) is None
    assert check_paging(16, None, 64, 4) == Paging(16, 16, (0,), (16,))  # default: the dense cache's size
    assert pages_for(17, 16) == 2 and pages_for(0, 16) == 0
    with pytest.raises(ValueError, match="num_pages=8 needs a page_size"):
        check_paging(None, 8, 64, 4)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        check_paging(0, 8, 64, 4)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        check_paging(True, 8, 64, 4)
    with pytest.raises(ValueError, match="page_size=128 > max_len=64"):
        check_paging(128, 8, 64, 4)
    with pytest.raises(ValueError, match="num_pages must be an int >= 1"):
        check_paging(16, 2.5, 64, 4)
    with pytest.raises(ValueError, match=r"num_pages=3 cannot hold one max_len=64 .* = 4 pages"):
        check_paging(16, 3, 64, 4)


def test_window_layers_get_a_pool_of_their_window_and_return_pages_it_leaves_behind():
    # layers (sliding 4, full, sliding 4, sliding 40 >= max_len: full as far as the cache goes)
    p = check_paging(4, 24, 32, 4, (4, 0, 4, 40), decode_steps=3)
    # a decoding slot holds positions [L - 3, L + 3): at most 3 pages; 4 slots: 12 of a window pool
    assert p == Paging(4, 24, (0, 4), (24, 12), (1, 0, 1, 0))
    kinds, base, scratch, units = pool_units(p, 4)
    assert base.tolist() == [50, 0, 63, 25] and scratch.tolist() == [62, 24, 75, 49] and units == 76
    assert check_paging(4, 8, 32, 4, (4, 0), decode_steps=3).pool_pages == (8, 8)  # never above num_pages
    t = PageTable(2, 32, *p)
    assert t.ensure(0, 13, start=10, cached=10)  # 10 cached + 3 to decode
    assert t.table[0, 0].tolist() == [0, 1, 2, 3] + [24] * 4
    assert t.table[0, 1].tolist() == [12, 0, 1, 2] + [12] * 4  # positions 7..12 only
    assert t.ensure_many({0: (23, 20, 20)})  # the slot decoded on to 20: pages 1..3 go back first
    assert t.table[0, 1].tolist() == [12] * 4 + [0, 1, 12, 12] and t.free_counts == (18, 10)
    # an append of 10 tokens at 20: the keys before it [17, 20) and the window after it are kept,
    # the page between (written and read only by the append itself) is returned
    assert t.needed(0, 33, start=20, cached=30) == 2 + 2
    assert t.ensure(0, 33, start=20, cached=30)
    assert t.table[0, 1].tolist() == [12] * 4 + [0, 12, 1, 2] and t.owned[0].tolist() == [8, 3]
    small = PageTable(1, 32, 4, 8, (4,), (3,))  # a window-only model
    assert not small.ensure(0, 32) and small.free_counts == (3,)  # start 0: all 8 window pages
    assert small.ensure(0, 32, start=29) and small.owned[0].tolist() == [2]  # [26, 32)
    t.release(0)
    assert t.free_counts == (24, 12) and (t.table == t.scratch[None, :, None]).all()
