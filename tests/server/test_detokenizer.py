"""Incremental detokenization: the stream equals a full decode, a character split across
tokens is held until it is whole (never U+FFFD), bytes that can never decode are dropped
mid-stream, and only an unfinished character at the very end becomes U+FFFD. For every
kind of tokenizer real checkpoints ship (tests/server/tokenizers_zoo.py)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pagefleet.server.engine.detokenizer import IncrementalDetokenizer, find_stop
from tests.server import tokenizers_zoo as zoo

TEXT = "Grüße, 世界! The model → token cache 🚀 done. Ça va? Привет"
FFFD = "\ufffd"

ZOO = {"bytelevel": zoo.bytelevel, "sentencepiece": zoo.sentencepiece,
       "metaspace": lambda: zoo.sentencepiece(metaspace=True)}


@pytest.fixture(scope="module", params=list(ZOO))
def tok(request):
    return ZOO[request.param]()


def stream(detok, state, ids):
    return [detok.step(state, t) for t in ids]


def test_stream_equals_full_decode(tiny_models):
    tok = AutoTokenizer.from_pretrained(str(tiny_models("qwen3")))
    detok = IncrementalDetokenizer(tok)
    assert detok.plan is not None                    # the byte path, not the fallback
    ids = tok.encode(TEXT)
    state = detok.start(tok.encode("Say hello:"))
    pieces = stream(detok, state, ids)
    assert "".join(pieces) == state.text == TEXT
    assert "" in pieces                              # multi-byte chars span tokens: held
    assert not any(FFFD in p for p in pieces)
    special = tok.convert_tokens_to_ids("<|im_end|>")
    assert detok.step(state, special) == ""          # skipped special token
    assert detok.step(state, 10**6) == ""            # padded vocab row: no text
    assert detok.finish(state) == "" and state.text == TEXT


def test_every_tokenizer_kind_streams_whole_characters(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.plan is not None
    ids = tok.encode(TEXT, add_special_tokens=False)
    byte_tokens = [t for t in ids if FFFD in tok.decode([t])]
    assert byte_tokens, "the text must exercise characters split over byte tokens"
    state = detok.start(tok.encode("Say hello:", add_special_tokens=False))
    pieces = stream(detok, state, ids)
    assert not any(FFFD in p for p in pieces)
    # Mid-text the first token keeps its leading space (SentencePiece strips it only at
    # the very start of the text); otherwise the stream is exactly decode().
    assert state.text.lstrip(" ") == tok.decode(ids) == TEXT
    assert state.text == TEXT or state.text == " " + TEXT


def test_sentencepiece_strips_the_leading_space_only_at_the_start():
    for tok in (zoo.sentencepiece(), zoo.sentencepiece(metaspace=True)):
        detok = IncrementalDetokenizer(tok)
        ids = tok.encode("Hello world", add_special_tokens=False)
        at_start = detok.start([tok.bos_token_id])          # only a skipped special token
        # (Metaspace drops every "▁" of the text's first token, as tokenizers does.)
        assert "".join(stream(detok, at_start, ids)) == tok.decode(ids)
        assert tok.decode(ids).replace(" ", "") == "Helloworld"
        mid = detok.start(tok.encode("Say:", add_special_tokens=False))
        assert "".join(stream(detok, mid, ids)) == " Hello world"
        keep = detok.start([tok.bos_token_id], skip_special_tokens=False)
        assert "".join(stream(detok, keep, ids)) == " Hello world"   # "<s>" is text now


def test_character_split_between_prompt_and_output_comes_out_whole(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("ab 世界", add_special_tokens=False)
    # Find a cut inside a character: the prefix's decode ends unfinished.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    state = detok.start(ids[:cut])
    out = "".join(stream(detok, state, ids[cut:]))
    assert FFFD not in out and out.endswith("界") and "ab" not in out   # no prompt text repeated
    assert tok.decode(ids[:cut]).rstrip(FFFD) + out in ("ab 世界", " ab 世界")


def test_invalid_bytes_are_dropped_mid_stream_and_flagged_only_at_the_end(tok):
    detok = IncrementalDetokenizer(tok)
    byte_id = {}
    for t in range(len(tok)):
        b = detok._bytes(t)
        if len(b) == 1 and b[0] >= 0x80:
            byte_id[b[0]] = t
    lead, cont = byte_id.get(0xE4), byte_id.get(0xB8)
    if lead is None or cont is None:
        pytest.skip("vocabulary lacks the single-byte tokens")
    a = tok.encode("a", add_special_tokens=False)
    state = detok.start(tok.encode("x", add_special_tokens=False))
    # A lead byte interrupted by ASCII, then a stray continuation byte, then text.
    pieces = stream(detok, state, [lead] + a + [cont] + a)
    assert not any(FFFD in p for p in pieces)
    assert state.text.replace(" ", "") == "aa"
    # An unfinished character at the very end of the output: held, then U+FFFD.
    assert detok.step(state, lead) == "" and detok.step(state, cont) == ""
    assert detok.finish(state) == FFFD and state.text.endswith("a" + FFFD)


def test_random_token_streams_never_send_replacement_characters(tok):
    """What a random-weight model does: arbitrary ids, byte tokens included."""
    detok = IncrementalDetokenizer(tok)
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(60)]
        state = detok.start(tok.encode("Hi", add_special_tokens=False))
        pieces = stream(detok, state, ids)
        assert not any(FFFD in p for p in pieces)
        full = tok.decode(ids, skip_special_tokens=True)
        if FFFD not in full:        # valid UTF-8 throughout: the stream is exactly decode()
            assert state.text.lstrip(" ") == full.lstrip(" ")
        tail = detok.finish(state)
        assert tail in ("", FFFD)


def test_bytelevel_random_stream_is_decode_without_replacements():
    tok = zoo.bytelevel()
    detok = IncrementalDetokenizer(tok)
    rng = random.Random(3)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(50)]
        state = detok.start([])
        stream(detok, state, ids)
        # Python's and Rust's lossy UTF-8 decoders replace the same maximal invalid
        # subparts, so dropping them equals decode() minus its U+FFFDs.
        assert state.text == tok.decode(ids, skip_special_tokens=True).replace(FFFD, "")


def test_tokenizer_without_byte_tokens_falls_back_to_decode_stream():
    tok = zoo.wordlevel()
    detok = IncrementalDetokenizer(tok)
    assert detok.plan is None
    ids = tok.encode("the model streams tokens", add_special_tokens=False)
    state = detok.start(tok.encode("Hello", add_special_tokens=False))
    stream(detok, state, ids)
    assert state.text == " " + tok.decode(ids)
    assert detok.finish(state) == ""


def test_non_special_added_tokens_stay_in_the_text():
    tok = zoo.bytelevel()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("<tool_call> ok", add_special_tokens=False)
    state = detok.start([])
    stream(detok, state, ids)
    assert state.text == "<tool_call> ok"


def test_find_stop_earliest_from_start():
    assert find_stop("abc STOP def END", ("END", "STOP"), 0) == (4, "STOP")
    assert find_stop("abc STOP def END", ("END", "STOP"), 5) == (13, "END")
    assert find_stop("abc", ("x",), 0) is None
