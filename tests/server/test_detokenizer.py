"""Incremental detokenization equals a full decode, multi-byte characters included."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagefleet.server.engine.detokenizer import IncrementalDetokenizer, find_stop


def test_stream_equals_full_decode(tiny_models):
    tok = AutoTokenizer.from_pretrained(str(tiny_models("qwen3")))
    detok = IncrementalDetokenizer(tok)
    text = "Grüße, 世界! The model → token cache 🚀 done."
    ids = tok.encode(text)
    prompt = tok.encode("Say hello:")
    state = detok.start(prompt)
    pieces = [detok.step(state, t) for t in ids]
    assert "".join(pieces) == state.text == text
    assert "" in pieces or len(ids) == len(text)   # multi-byte chars span tokens
    special = tok.convert_tokens_to_ids("<|im_end|>")
    assert detok.step(state, special) == ""          # skipped special token
    assert detok.step(state, 10**6) == ""            # padded vocab row: no text


def test_find_stop_earliest_from_start():
    assert find_stop("abc STOP def END", ("END", "STOP"), 0) == (4, "STOP")
    assert find_stop("abc STOP def END", ("END", "STOP"), 5) == (13, "END")
    assert find_stop("abc", ("x",), 0) is None
