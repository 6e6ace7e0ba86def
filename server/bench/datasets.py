"""Prompts for `pagefleet bench serve`: random, and shared-prefix (prefix-cache runs).

No tokenizer is loaded on the client: prompts are built from a fixed word list, with a
words-per-token ratio measured once through the server's `/tokenize` (vLLM and
pagefleet both have it), so input lengths land close to the asked token counts. The
report uses the server's own `usage` counts, so figures are exact either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact water room mother area "
    "money story month lot right study book job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office "
    "door health art war history party result change morning reason research girl guy "
    "moment air teacher force education river cloud stone green quiet bright small early"
).split()


@dataclass
class SampleRequest:
    prompt: str
    expected_input_len: int
    output_len: int


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _text(rng: random.Random, num_tokens: int, tokens_per_word: float) -> str:
    n_words = max(1, round(num_tokens / max(tokens_per_word, 1e-6)))
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   *, seed: int = 0, prefix_len: int = 0, num_prefixes: int = 1,
                   tokens_per_word: float = 1.0) -> list[SampleRequest]:
    """Random prompts of about `input_len` tokens (± range_ratio), optionally each after
    one of `num_prefixes` shared prefixes of `prefix_len` tokens (prefix-cache runs)."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    prefixes = [_text(rng, prefix_len, tokens_per_word) + " " if prefix_len else ""
                for _ in range(max(1, num_prefixes))]
    ins = _lengths(rng, input_len, range_ratio, num_prompts)
    outs = _lengths(rng, output_len, range_ratio, num_prompts)
    return [SampleRequest(prefixes[i % len(prefixes)] + _text(rng, n_in, tokens_per_word),
                          prefix_len + n_in, n_out)
            for i, (n_in, n_out) in enumerate(zip(ins, outs))]
