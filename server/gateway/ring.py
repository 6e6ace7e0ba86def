"""Consistent-hash ring of a pool's replicas (pure).

Each replica gets `vnodes` points at blake2b(name#i); a key walks clockwise and meets
the replicas in a fixed order. Positions depend only on replica names, so gateway
replicas that share nothing agree on where a new prefix goes, and a replica joining or
leaving moves only the keys next to its points.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator


def _point(name: str, i: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}#{i}".encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: Iterable[str], vnodes: int = 64) -> None:
        self.names = frozenset(names)
        points = sorted((_point(n, i), n) for n in self.names for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: int) -> Iterator[str]:
        """Every replica once, in ring order from `key`."""
        if not self._keys:
            return
        start = bisect.bisect_left(self._keys, key)
        seen: set[str] = set()
        n = len(self._keys)
        for j in range(n):
            owner = self._owners[(start + j) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.names):
                    return
