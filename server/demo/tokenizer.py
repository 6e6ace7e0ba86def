"""The demo model's tokenizer: a byte-level BPE trained on the synthetic corpus.

Byte-level, as Qwen's and Llama 3's are: every string the user sends has an encoding
(unknown characters become byte tokens), and the vocabulary can stay small. Digits
are split one by one (as Qwen does), so numbers in tool results are copied digit by
digit instead of needing a token per number.
"""

from __future__ import annotations

from pathlib import Path

import json

from pagefleet.server.demo.corpus import sample_text
from pagefleet.server.demo.template import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS


def _renderer():
    """The chat template in plain Jinja, for the BPE's training text only (the model's
    training examples go through the tokenizer's own `apply_chat_template`)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(CHAT_TEMPLATE)
    return lambda d: template.render(messages=d.messages, tools=d.tools,
                                     add_generation_prompt=False)


def train_tokenizer(seed: int, vocab_size: int, n_dialogues: int = 20000):
    """Train the BPE on `n_dialogues` dialogues of the corpus; returns an HF fast tokenizer
    with the chat template and the ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_text(seed, n_dialogues, _renderer()), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def save_tokenizer(fast, path: str | Path) -> None:
    fast.save_pretrained(str(path))
