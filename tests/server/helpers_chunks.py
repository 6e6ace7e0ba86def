"""Ways to cut one model output into stream chunks, for the parsers' stream tests.

A streaming parser must give the same message however the detokenizer happens to cut
the text, so the tests feed every chunking here: each single cut point, one character
at a time, and seeded random cuts into up to eight pieces.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def chunkings(text: str, *, random_cuts: int = 40, seed: int = 0) -> Iterator[list[str]]:
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(random_cuts):
        k = min(n + 1, rng.randint(2, 8))
        cuts = sorted(rng.sample(range(n + 1), k))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
