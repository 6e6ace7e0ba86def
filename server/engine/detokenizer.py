"""Incremental detokenization and stop strings.

Decoding the whole output every step is quadratic, and decoding each token alone
breaks multi-byte characters: byte-level BPEs (GPT-2, Llama 3, Qwen) and SentencePiece
byte fallback (Llama 2, Mistral) split a character's UTF-8 bytes over several tokens.
So the detokenizer works on bytes, as the tokenizer's own decoder does: each token
stands for a byte string, read once off the tokenizer's decoder description and
cached, and the output is one UTF-8 byte stream decoded incrementally:

- a complete character is emitted as soon as its last byte arrives;
- the bytes of an unfinished character are held (nothing is emitted for them) until
  the token that completes it, as vLLM's incremental detokenizer does;
- bytes that can never form a character (a stray continuation byte, a lead byte
  followed by a non-continuation byte) are dropped from the text: a client must never
  see U+FFFD for them mid-stream (issue 16). The token ids still carry them;
- `finish()` flushes a character left unfinished at the very end of the output as
  U+FFFD, the one place where the model really ended on invalid UTF-8.

The stream is primed with the prompt's last tokens, so that a character split between
prompt and output comes out whole, and so that SentencePiece's "strip the leading
space at the start of the text" applies only when no text precedes (mid-text, the
first output token keeps its space, as in vLLM).

Tokenizers whose decoder has no byte tokens and is not one of the above (WordPiece,
no decoder at all, ...) go through the tokenizers library's `DecodeStream`, which
holds text ending in U+FFFD and returns only new text. The byte description is
checked against the tokenizer's own `decode` on a sample of the vocabulary when the
detokenizer is built; on any disagreement it falls back to `DecodeStream` too.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

log = logging.getLogger("pagefleet.detokenizer")

PROMPT_CONTEXT_TOKENS = 5
_BYTE_TOKEN = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def _bytelevel_table() -> dict[str, int]:
    """GPT-2's byte <-> printable-character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTELEVEL = _bytelevel_table()


class UnsupportedDecoder(ValueError):
    pass


@dataclass(frozen=True)
class BytePlan:
    """How a tokenizer's decoder turns one token into bytes.

    `steps` run on each token in order ("bytelevel", "bytefallback", ("replace", a, b),
    ("metaspace", char)); `strip` is (byte, n): up to n leading copies of that byte are
    removed from the start of the whole text (the `Strip` decoder after `Fuse`).
    """
    steps: tuple
    strip: tuple[int, int] | None = None

    @classmethod
    def from_decoder(cls, decoder: dict | None) -> "BytePlan":
        if decoder is None:
            raise UnsupportedDecoder("no decoder: tokens are joined with spaces")
        parts = decoder["decoders"] if decoder["type"] == "Sequence" else [decoder]
        steps: list = []
        strip = None
        fused = False
        for d in parts:
            kind = d["type"]
            if kind == "ByteLevel":
                steps.append("bytelevel")
                fused = True        # ByteLevel joins every token's bytes into one string
            elif kind == "ByteFallback":
                steps.append("bytefallback")
            elif kind == "Fuse":
                fused = True
            elif kind == "Replace":
                pattern = d["pattern"]
                if "String" not in pattern:
                    raise UnsupportedDecoder("Replace with a regex")
                if fused and len(pattern["String"]) != 1:
                    raise UnsupportedDecoder("multi-character Replace after Fuse")
                steps.append(("replace", pattern["String"].encode(), d["content"].encode()))
            elif kind == "Strip":
                content = d["content"].encode()
                if d.get("stop") or len(content) != 1 or not fused:
                    raise UnsupportedDecoder(f"Strip {d}")
                strip = (content[0], int(d.get("start", 0)))
            elif kind == "Metaspace":
                if d.get("prepend_scheme", "always") == "never" and not d.get("add_prefix_space", True):
                    steps.append(("replace", d["replacement"].encode(), b" "))
                else:
                    steps.append(("metaspace", d["replacement"].encode()))
            else:
                raise UnsupportedDecoder(f"decoder {kind}")
        return cls(tuple(steps), strip)

    def token_bytes(self, piece: str, first: bool) -> bytes:
        """The bytes of one token; `first`: it is the first token of the text."""
        value: bytes = piece.encode()
        for step in self.steps:
            if step == "bytelevel":
                chars = value.decode()
                if all(c in _BYTELEVEL for c in chars):
                    value = bytes(_BYTELEVEL[c] for c in chars)
            elif step == "bytefallback":
                m = _BYTE_TOKEN.fullmatch(value)
                if m:
                    value = bytes([int(m.group(1), 16)])
            elif step[0] == "replace":
                value = value.replace(step[1], step[2])
            else:                                   # metaspace
                value = value.replace(step[1], b"" if first else b" ")
        return value


@dataclass
class DetokState:
    text: str = field(default="")
    skip_special_tokens: bool = True
    utf8: codecs.IncrementalDecoder | None = None
    seen_token: bool = False       # a non-skipped token precedes (SentencePiece's "first")
    strip_left: int = 0            # leading strip bytes still to remove
    stream: DecodeStream | None = None   # fallback for decoders without a byte plan


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="ignore")


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.backend = tokenizer.backend_tokenizer   # fast tokenizers only
        self.vocab_len = len(tokenizer)
        self.special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                                     if t.special)
        self._cache: dict[int, bytes] = {}
        try:
            self.plan: BytePlan | None = BytePlan.from_decoder(
                json.loads(self.backend.to_str()).get("decoder"))
            self._check_plan()
        except UnsupportedDecoder as e:
            log.debug("detokenizer: %s; using tokenizers' DecodeStream", e)
            self.plan = None

    # -- bytes of tokens --------------------------------------------------------------
    def _bytes(self, token_id: int, first: bool = False) -> bytes:
        if not first:
            b = self._cache.get(token_id)
            if b is not None:
                return b
        piece = self.backend.id_to_token(token_id)
        b = b"" if piece is None else self.plan.token_bytes(piece, first)
        if not first:
            self._cache[token_id] = b
        return b

    def _check_plan(self) -> None:
        """The plan must decode like the tokenizer itself: every sampled token alone, runs
        of whole-text tokens together (spaces, SentencePiece's first-token rule), and a
        text of multi-byte characters through the tokenizer's own encoding. (Sequences of
        invalid bytes are not compared: ByteFallback turns a whole run of byte tokens
        into U+FFFD when any of them is invalid, where this keeps the valid ones.)"""
        n = self.backend.get_vocab_size(with_added_tokens=True)
        stride = max(1, n // 256)
        ids = sorted(set(range(0, n, stride)) | set(self.backend.get_added_tokens_decoder()))
        ids = [i for i in ids if i < self.vocab_len and self.backend.id_to_token(i) is not None]
        whole = [i for i in ids if "\ufffd" not in self.backend.decode([i], skip_special_tokens=False)]
        probe = self.backend.encode("Grüße, 世界 → 🚀 ok", add_special_tokens=False).ids
        for seq in [[i] for i in ids] + [whole[k:k + 16] for k in range(0, len(whole), 16)] + [probe]:
            state = self._start_bytes([], skip_special_tokens=False)
            state.utf8.errors = "replace"
            mine = "".join(self._step_bytes(state, t) for t in seq)
            mine += state.utf8.decode(b"", final=True)
            theirs = self.backend.decode(seq, skip_special_tokens=False)
            if mine != theirs:
                raise UnsupportedDecoder(f"byte plan disagrees with decode() on {seq[:4]}...: "
                                         f"{mine[:40]!r} != {theirs[:40]!r}")

    # -- the interface ------------------------------------------------------------------
    def start(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> DetokState:
        ctx = [t for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:] if 0 <= t < self.vocab_len]
        if self.plan is None:
            return DetokState(skip_special_tokens=skip_special_tokens,
                              stream=DecodeStream(ctx, skip_special_tokens=skip_special_tokens))
        state = self._start_bytes(ctx, skip_special_tokens)
        if len(prompt_ids) > PROMPT_CONTEXT_TOKENS:
            state.seen_token, state.strip_left = True, 0    # text precedes the window
        return state

    def step(self, state: DetokState, token_id: int) -> str:
        """Account for one new token; return the new text (possibly empty)."""
        if not 0 <= token_id < self.vocab_len:
            return ""   # padded vocabulary rows have no text
        if state.stream is not None:
            new = state.stream.step(self.backend, token_id) or ""
        else:
            new = self._step_bytes(state, token_id)
        state.text += new
        return new

    def finish(self, state: DetokState) -> str:
        """End of the output: an unfinished character becomes U+FFFD (the model really
        ended on invalid UTF-8). Returns that text, also appended to `state.text`."""
        if state.utf8 is None:
            return ""
        state.utf8.errors = "replace"
        new = state.utf8.decode(b"", final=True)
        state.text += new
        return new

    # -- the byte path -----------------------------------------------------------------
    def _start_bytes(self, ctx: list[int], skip_special_tokens: bool) -> DetokState:
        strip_left = self.plan.strip[1] if self.plan and self.plan.strip else 0
        state = DetokState(skip_special_tokens=skip_special_tokens, utf8=_utf8_decoder(),
                           strip_left=strip_left)
        for t in ctx:
            self._step_bytes(state, t)    # carries a split character and the "first" flags
        return state

    def _step_bytes(self, state: DetokState, token_id: int) -> str:
        if state.skip_special_tokens and token_id in self.special_ids:
            return ""
        b = self._bytes(token_id, first=not state.seen_token)
        state.seen_token = True
        if state.strip_left:
            byte, _ = self.plan.strip
            k = 0
            while k < len(b) and k < state.strip_left and b[k] == byte:
                k += 1
            state.strip_left = 0 if k < len(b) else state.strip_left - k
            b = b[k:]
        return state.utf8.decode(b)


def find_stop(text: str, stop_strings: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """First stop string occurring in text at or after `start` (earliest wins)."""
    best: tuple[int, str] | None = None
    for s in stop_strings:
        i = text.find(s, max(0, start))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
