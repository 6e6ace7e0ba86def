"""KV cache block pool: reference counts, hash-chained prefix cache, LRU reuse.

Pure bookkeeping (no tensors): which physical blocks each request owns. A full block's
hash chains its parent's hash and its token ids, so equal hashes mean equal prefixes.
Freed blocks keep their hash and sit in an LRU free list: a later request with the
same prefix takes them back (a cache hit); a request that needs fresh blocks takes the
least recently freed one and evicts its hash.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pagefleet.server.engine.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass
class CacheStats:
    queries: int = 0   # prompt tokens looked up in the prefix cache
    hits: int = 0      # of which found cached


@dataclass
class _ReqBlocks:
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # hashes of its full blocks so far
    num_published: int = 0                               # leading blocks already in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first. Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.req_blocks: dict[str, _ReqBlocks] = {}
        self.stats = CacheStats()

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        rb = self.req_blocks.get(request_id)
        return rb.blocks if rb else []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------
    def _block_hashes(self, req: Request, upto_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks within its first `upto_tokens` tokens."""
        rb = self.req_blocks.setdefault(req.request_id, _ReqBlocks())
        bs, ids = self.block_size, req.all_token_ids
        while (len(rb.hashes) + 1) * bs <= upto_tokens:
            i = len(rb.hashes)
            parent = rb.hashes[-1] if rb.hashes else None
            rb.hashes.append(hash_block(parent, ids[i * bs:(i + 1) * bs]))
        return rb.hashes[: upto_tokens // bs]

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks for the start of a request with nothing computed yet.

        At most `num_tokens - 1` tokens can hit: the last token is always computed, so
        that the step produces its logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hits: list[int] = []
        for h in self._block_hashes(req, req.num_tokens - 1):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix-cache lookup once its request is actually scheduled."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    # -- allocation ----------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens (after its computed ones).

        `computed_blocks` are prefix-cache hits to take first. Returns False, changing
        nothing, when the pool cannot supply the blocks.
        """
        rb = self.req_blocks.get(req.request_id)
        if rb is not None and not computed_blocks and \
                (req.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size \
                <= len(rb.blocks):
            return True   # the common decode step: room left in the last block
        computed_blocks = computed_blocks or []
        if rb is None:
            rb = self.req_blocks[req.request_id] = _ReqBlocks()
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(rb.blocks) - len(computed_blocks)
        # Hits that sit in the free list leave it when taken, so they count against it too.
        free_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if max(need, 0) + free_hits > len(self.free):
            return False
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
            rb.blocks.append(b)
        for _ in range(max(need, 0)):
            b, _ = self.free.popitem(last=False)
            block = self.blocks[b]
            if block.hash is not None:
                if self.cached.get(block.hash) == b:
                    del self.cached[block.hash]
                block.hash = None
            block.ref_count = 1
            rb.blocks.append(b)
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish the hashes of the request's full blocks whose KV is now computed.

        Called once the step that writes them is launched (the device runs it before
        any later step that reads them), never at scheduling: a block published then
        could be hit by a request whose writer is preempted in the same pass.
        """
        if not self.enable_prefix_caching:
            return
        rb = self.req_blocks.get(req.request_id)
        if rb is None or req.num_computed_tokens // self.block_size <= rb.num_published:
            return   # no block became full since the last call
        hashes = self._block_hashes(req, req.num_computed_tokens)
        for i in range(rb.num_published, len(hashes)):
            block = self.blocks[rb.blocks[i]]
            if block.hash is None:
                block.hash = hashes[i]
                self.cached.setdefault(hashes[i], block.block_id)
        rb.num_published = max(rb.num_published, len(hashes))

    def free_request(self, request_id: str) -> None:
        """Drop a request's blocks. Tail blocks are freed first so they are evicted
        first: a later request sharing the prefix keeps the head blocks longest."""
        rb = self.req_blocks.pop(request_id, None)
        if rb is None:
            return
        for b in reversed(rb.blocks):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self.free[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (only while no request holds blocks: a
        running request's published blocks must stay findable). True if it did."""
        if self.req_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.hash = None
        return True

    def check_whole(self) -> None:
        """Assert the pool is whole: no request holds blocks, every ref count is 0."""
        assert not self.req_blocks, f"requests still hold blocks: {list(self.req_blocks)}"
        leaked = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not leaked, f"blocks with leftover references: {leaked[:10]}"
        assert len(self.free) == self.num_blocks, "free list does not hold every block"
