"""Offline tokenizers of the kinds real checkpoints ship, for detokenizer tests.

Byte-level BPE (GPT-2 / Llama 3 / Qwen), SentencePiece-style BPE with byte fallback
(Llama 2 / Mistral: `<0xNN>` tokens, `▁` for spaces, the leading space stripped at
the start of the text; both the Replace+Strip decoder of HF's converter and the
Metaspace decoder), and a WordLevel vocabulary without a decoder (tokens joined by
spaces, as the GPU benchmarks' tokenizer is).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world, the model streams tokens to the client.",
    "Grüße aus München! Ça va très bien, merci.",
    "The cache holds blocks; each block holds sixteen tokens.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Numbers like 12345 and 67890 are split into digits.",
] * 20


def _fast(tok: Tokenizer, **kw) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kw)


def bytelevel() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_tokens(["<tool_call>"])
    return _fast(tok, eos_token="<|im_end|>")


def _sentencepiece_bpe() -> Tokenizer:
    """A BPE over `▁`-joined words with the 256 `<0xNN>` byte tokens, as Llama 2's."""
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(base.get_vocab(), key=base.get_vocab().get):
        vocab.setdefault(piece, len(vocab))
    import json
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in json.loads(base.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>",
                               fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def sentencepiece(metaspace: bool = False) -> PreTrainedTokenizerFast:
    tok = _sentencepiece_bpe()
    if metaspace:
        tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                         decoders.ByteFallback(), decoders.Fuse()])
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return _fast(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def wordlevel() -> PreTrainedTokenizerFast:
    words = sorted({w for line in CORPUS for w in line.split()})
    tok = Tokenizer(models.WordLevel({w: i + 2 for i, w in enumerate(words)} | {"<unk>": 0, "</s>": 1},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "</s>"])
    return _fast(tok, eos_token="</s>", unk_token="<unk>")
