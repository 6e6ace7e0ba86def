"""Prefix identity at block granularity: the engine's own hash chain, and a model of
what each replica's prefix cache holds.

The engine caches a request's KV in blocks of `block_size` tokens; a full block's hash
chains its parent's hash and its token ids (`kv_cache.hash_block`). Two prompts share
cached KV exactly as far as their chains agree, so the gateway computes the same chain
(not a character heuristic) and remembers which replica it sent which blocks to.

What the engine looks up and what it stores differ by one token: the last prompt token
is always computed (its logits are needed), so a lookup covers the full blocks of the
first `n - 1` tokens, while after prefill all `n // block_size` full blocks are cached.

`PrefixIndex` mirrors each replica's cache from what the gateway routed there: an LRU
per replica bounded by the replica's KV capacity (`num_gpu_blocks`, scraped from
`vllm:cache_config_info`) and aged by a TTL. Blocks are recorded tail first so that a
prompt's head blocks are the most recent and are evicted last, as the engine frees
tail blocks first. It is an estimate (other gateways and direct clients also fill the
caches), which is why routing still bounds load.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagefleet.server.engine.kv_cache import hash_block

UNKNOWN_CAPACITY = 1 << 20   # blocks, until the replica's num_gpu_blocks is scraped


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt's block-hash chain for one block size."""

    hashes: tuple[bytes, ...]    # every full block of the prompt (what gets cached)
    lookup: int                  # leading blocks a lookup can hit: (n - 1) // block_size

    @property
    def lookup_hashes(self) -> tuple[bytes, ...]:
        return self.hashes[:self.lookup]


def prompt_blocks(token_ids: list[int], block_size: int) -> PromptBlocks:
    """The engine's chain over the prompt's full blocks (pure)."""
    n = len(token_ids)
    hashes: list[bytes] = []
    parent = None
    for i in range(n // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return PromptBlocks(tuple(hashes), max(n - 1, 0) // block_size)


def ring_key(blocks: PromptBlocks, ring_blocks: int) -> tuple[int, int] | None:
    """(ring position, root block index) from the chain hash of the first
    min(ring_blocks, lookup) blocks, or None for a prompt with no full block to look up.

    The chain hash at block i covers blocks 0..i, so the key names the whole start of
    the prompt: turns of one conversation (and users of one long system prompt) share
    it, while prompts that only share a chat template's first tokens do not.
    """
    k = min(ring_blocks, blocks.lookup)
    if k == 0:
        return None
    return int.from_bytes(blocks.hashes[k - 1][:8], "big"), k - 1


class _ReplicaCache:
    __slots__ = ("entries", "capacity", "roots")

    def __init__(self, capacity: int) -> None:
        self.entries: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()  # -> (time, root)
        self.capacity = capacity
        self.roots = 0

    def _drop_first(self) -> None:
        _, (_, root) = self.entries.popitem(last=False)
        if root:
            self.roots -= 1

    def purge(self, now: float, ttl: float) -> None:
        limit = now - ttl
        while self.entries:
            t, _ = next(iter(self.entries.values()))
            if t >= limit:
                break
            self._drop_first()
        while len(self.entries) > self.capacity:
            self._drop_first()


class PrefixIndex:
    """Which leading blocks each replica of one pool probably holds (bounded, aged)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._replicas: dict[str, _ReplicaCache] = {}

    def _cache(self, replica: str) -> _ReplicaCache:
        c = self._replicas.get(replica)
        if c is None:
            c = self._replicas[replica] = _ReplicaCache(UNKNOWN_CAPACITY)
        return c

    def set_capacity(self, replica: str, num_blocks: int) -> None:
        self._cache(replica).capacity = max(int(num_blocks), 1)

    def forget(self, replica: str) -> None:
        """The replica restarted or left: its cache is gone."""
        self._replicas.pop(replica, None)

    def record(self, replica: str, blocks: PromptBlocks, root: int | None, now: float) -> None:
        """The replica was sent this prompt: after its prefill it holds every full block."""
        c = self._cache(replica)
        for i in range(len(blocks.hashes) - 1, -1, -1):   # tail first: head most recent
            h = blocks.hashes[i]
            old = c.entries.pop(h, None)
            is_root = i == root or (old is not None and old[1])
            if old is not None and old[1]:
                c.roots -= 1
            if is_root:
                c.roots += 1
            c.entries[h] = (now, is_root)
        c.purge(now, self.ttl)

    def match(self, replica: str, hashes: tuple[bytes, ...], now: float) -> int:
        """Leading blocks of `hashes` the replica holds."""
        c = self._replicas.get(replica)
        if c is None:
            return 0
        c.purge(now, self.ttl)
        n = 0
        for h in hashes:
            if h not in c.entries:
                break
            n += 1
        return n

    def groups(self, replica: str, now: float) -> int:
        """Distinct prompt starts (ring keys) the replica holds: its share of the
        prefixes, which ring placement of new prefixes keeps balanced."""
        c = self._replicas.get(replica)
        if c is None:
            return 0
        c.purge(now, self.ttl)
        return c.roots

    def size(self, replica: str) -> int:
        c = self._replicas.get(replica)
        return len(c.entries) if c else 0
