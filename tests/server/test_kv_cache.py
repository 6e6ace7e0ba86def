"""Block pool bookkeeping: ref counts, hash-chained prefix cache, LRU reuse."""

from __future__ import annotations

from pagefleet.server.engine.kv_cache import KVCacheManager, hash_block
from pagefleet.server.engine.request import Request
from pagefleet.server.engine.protocol import CoreSamplingParams as SamplingParams


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=4))


def computed(kv: KVCacheManager, r: Request, n: int) -> None:
    """What the scheduler + engine do: allocate n new tokens, run, publish."""
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    kv.cache_computed_blocks(r)


def test_hash_chains_parent():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_allocate_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    r = req("a", list(range(10)))
    computed(kv, r, 10)
    assert len(kv.blocks_of("a")) == 3 and kv.num_free_blocks == 5
    kv.free_request("a")
    kv.check_whole()


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2 and kv.blocks_of("a") == []


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(10)))
    computed(kv, a, 10)
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.blocks_of("a")[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert [kv.blocks[x].ref_count for x in hits] == [2, 2]
    kv.free_request("a")
    assert [kv.blocks[x].ref_count for x in hits] == [1, 1]
    kv.free_request("b")
    kv.check_whole()


def test_fully_cached_prompt_still_computes_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(8)))
    computed(kv, a, 8)
    kv.free_request("a")
    again = req("a2", list(range(8)))
    hits, n = kv.get_computed_blocks(again)
    assert n == 4 and len(hits) == 1   # 7 tokens may hit -> one full block


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(8)))
    computed(kv, a, 8)
    kv.free_request("a")
    assert len(kv.cached) == 2 and kv.num_free_blocks == 4
    # A hit takes the cached block back out of the free list.
    b = req("b", list(range(4)) + [50, 51])
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 2, hits)
    assert kv.num_free_blocks == 2
    # A new request needing every other block evicts the remaining cached one.
    c = req("c", [70 + i for i in range(8)])
    assert kv.allocate_slots(c, 8)
    assert len(kv.cached) == 1   # only b's shared head block is still cached
    kv.free_request("b")
    kv.free_request("c")
    kv.check_whole()


def test_tail_blocks_evicted_before_head_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])
    computed(kv, a, 7)
    head, mid, tail = kv.blocks_of("a")[:3]
    kv.free_request("a")
    free_order = list(kv.free)
    assert free_order.index(tail) < free_order.index(mid) < free_order.index(head)


def test_no_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(10)))
    computed(kv, a, 10)
    assert kv.get_computed_blocks(req("b", list(range(10)))) == ([], 0)
    assert not kv.cached
