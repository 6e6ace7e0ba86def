"""Reasoning parsers: `<think>…</think>` split from content, whole and streamed.

Fixed model texts for both parsers, with the output starting inside the reasoning
(the template opened `<think>` in the prompt) or outside it; every text is streamed
cut at every point and must reassemble into the non-streamed split. Then the token
space: the `</think>` id found in a real tokenizer, and the boundary the engine uses
agreeing with the text splitter.
"""

from __future__ import annotations

import itertools

import pytest
from transformers import AutoTokenizer

from pagefleet.server.api.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningBoundary,
    ReasoningConfigError,
    content_start,
    get_reasoning_parser,
    think_token_ids,
)
from pagefleet.server.api.tool_parsers import HermesToolParser
from pagefleet.server.testing import build_tiny_model
from tests.server.helpers_chunks import chunkings

R1_PROMPT = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"
QWEN_THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_NO_THINK_PROMPT = QWEN_THINKING_PROMPT + "<think>\n\n</think>\n\n"
QWEN_2507_PROMPT = QWEN_THINKING_PROMPT + "<think>\n"
QWEN_HISTORY_PROMPT = ("<|im_start|>assistant\n<think>\nold\n</think>\n\n<tool_call>...</tool_call>"
                       "<|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response>"
                       "<|im_end|>\n<|im_start|>assistant\n")


def reassemble(parser, chunks):
    reasoning, content = [], []
    for d in [parser.feed(c) for c in chunks] + [parser.finish()]:
        if d is None:
            continue
        assert d.reasoning_content or d.content, "an empty delta was sent"
        assert d.reasoning_content != "" and d.content != ""
        if d.reasoning_content:
            reasoning.append(d.reasoning_content)
        if d.content:
            content.append(d.content)
    return "".join(reasoning) or None, "".join(content) or None


CASES = [
    # DeepSeek-R1: the prompt opened <think>; the output has only </think>
    (DeepSeekR1ReasoningParser, R1_PROMPT, "Two and two.\nFour.\n</think>\n\nThe answer is 4.",
     "Two and two.\nFour.", "The answer is 4."),
    # ... or the model wrote <think> itself anyway (older templates): stripped
    (DeepSeekR1ReasoningParser, None, "<think>\nSum it.\n</think>\n\n4", "Sum it.", "4"),
    # cut short while thinking: all reasoning
    (DeepSeekR1ReasoningParser, R1_PROMPT, "Let me think about", "Let me think about", None),
    (DeepSeekR1ReasoningParser, R1_PROMPT, "done</think>", "done", None),
    (DeepSeekR1ReasoningParser, R1_PROMPT, "", None, None),
    # the prompt closed the block (a hybrid template, thinking off): all content
    (DeepSeekR1ReasoningParser, QWEN_NO_THINK_PROMPT, '{"city": "Paris"}', None,
     '{"city": "Paris"}'),
    # content keeps later tags and its own whitespace
    (DeepSeekR1ReasoningParser, R1_PROMPT, "a</think>b <think> c </think> d  ", "a",
     "b <think> c </think> d  "),
    # Qwen3, thinking on, original template: the model opens the block
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "<think>\nThe user greets.\n</think>\n\nHello!",
     "The user greets.", "Hello!"),
    # <think> opens the reasoning only as the very first thing (as the first token)
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "\n<think>x</think>y", None,
     "\n<think>x</think>y"),
    # Qwen3 deciding not to think: an empty block
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "<think>\n\n</think>\n\nHello!", None, "Hello!"),
    # no think block at all: all content, verbatim, even a stray tag
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "Hello!", None, "Hello!"),
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "  Hi </think> there", None,
     "  Hi </think> there"),
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "<thinking> is a word", None,
     "<thinking> is a word"),
    (Qwen3ReasoningParser, QWEN_THINKING_PROMPT, "<thi", None, "<thi"),
    # enable_thinking=False: the template closed an empty block in the prompt
    (Qwen3ReasoningParser, QWEN_NO_THINK_PROMPT, "Hello!", None, "Hello!"),
    (Qwen3ReasoningParser, QWEN_NO_THINK_PROMPT, "<think>x</think>y", "x", "y"),
    # Qwen3-Thinking-2507: the prompt opened <think>
    (Qwen3ReasoningParser, QWEN_2507_PROMPT, "Greeting.\n</think>\n\nHi!", "Greeting.", "Hi!"),
    (Qwen3ReasoningParser, QWEN_2507_PROMPT, "still thinking", "still thinking", None),
    # a think block in the history does not count: the last tag in the prompt decides
    (Qwen3ReasoningParser, QWEN_HISTORY_PROMPT, "<think>\nagain\n</think>\n\nDone.", "again",
     "Done."),
    (Qwen3ReasoningParser, QWEN_HISTORY_PROMPT, "Done.", None, "Done."),
    (Qwen3ReasoningParser, None, "<think>truncated", "truncated", None),
    (Qwen3ReasoningParser, None, "", None, None),
]


@pytest.mark.parametrize(("cls", "prompt", "text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed(cls, prompt, text, reasoning, content):
    assert cls.split(text, prompt=prompt) == (reasoning, content)
    for chunks in chunkings(text):
        assert reassemble(cls(prompt=prompt), chunks) == (reasoning, content), chunks


def test_where_the_output_starts():
    assert DeepSeekR1ReasoningParser.starts_in_reasoning(None)
    assert DeepSeekR1ReasoningParser.starts_in_reasoning(R1_PROMPT)
    assert DeepSeekR1ReasoningParser.starts_in_reasoning(QWEN_THINKING_PROMPT)   # no tag
    # a prompt that closed the block (thinking off) starts outside, as the engine's
    # grammar does (review finding 3: it used to be all reasoning)
    assert not DeepSeekR1ReasoningParser.starts_in_reasoning(QWEN_NO_THINK_PROMPT)
    assert not DeepSeekR1ReasoningParser.starts_in_reasoning(QWEN_HISTORY_PROMPT)
    assert not Qwen3ReasoningParser.starts_in_reasoning(None)
    assert not Qwen3ReasoningParser.starts_in_reasoning(QWEN_THINKING_PROMPT)
    assert not Qwen3ReasoningParser.starts_in_reasoning(QWEN_NO_THINK_PROMPT)
    assert not Qwen3ReasoningParser.starts_in_reasoning(QWEN_HISTORY_PROMPT)
    assert Qwen3ReasoningParser.starts_in_reasoning(QWEN_2507_PROMPT)
    # an explicit choice wins over the prompt
    assert Qwen3ReasoningParser.split("a</think>b", in_reasoning=True) == ("a", "b")


def test_stream_deltas_and_shape():
    p = Qwen3ReasoningParser(prompt=QWEN_THINKING_PROMPT)
    assert p.feed("<thi") is None
    assert not p.reasoning_ended
    assert p.feed("nk>\nStep one.\n").to_openai() == {"reasoning_content": "Step one.",
                                                      "reasoning": "Step one."}
    assert p.feed("Step two.</th").to_openai()["reasoning_content"] == "\nStep two."
    assert p.feed("ink>\n\nAnswer").to_openai() == {"content": "Answer"}
    assert p.reasoning_ended
    assert p.feed(" done.").to_openai() == {"content": " done."}
    assert p.finish() is None
    assert p.result() == ("Step one.\nStep two.", "Answer done.")


def test_tool_calls_are_parsed_from_the_content_only():
    """The server feeds the reasoning parser's content to the tool parser."""
    text = ('I should call <tool_call>{"name": "no", "arguments": {}}</tool_call> maybe.'
            '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            "\n</tool_call>")
    for chunks in itertools.islice(chunkings(text), 0, None, 5):
        rp, tp = DeepSeekR1ReasoningParser(), HermesToolParser()
        reasoning = []
        for piece in [*chunks, None]:
            d = rp.feed(piece) if piece is not None else rp.finish()
            if d is not None and d.reasoning_content:
                reasoning.append(d.reasoning_content)
            if d is not None and d.content:
                tp.feed(d.content)
        tp.finish()
        content, calls = tp.result()
        assert "".join(reasoning).startswith("I should call <tool_call>")
        assert content is None
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="choose from deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


# -- token space ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny model's real BPE tokenizer, without and with the think tokens added."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", num_layers=1,
                            hidden_size=32, num_heads=2, num_kv_heads=1)
    plain = AutoTokenizer.from_pretrained(str(path))
    thinking = AutoTokenizer.from_pretrained(str(path))
    thinking.add_tokens(["<think>", "</think>"], special_tokens=True)
    return plain, thinking


def test_think_token_ids(tokenizers):
    plain, thinking = tokenizers
    ids = think_token_ids(Qwen3ReasoningParser, thinking)
    assert thinking.convert_ids_to_tokens([ids.start, ids.end]) == ["<think>", "</think>"]
    with pytest.raises(ReasoningConfigError, match="no single token for '</think>'"):
        think_token_ids(Qwen3ReasoningParser, plain)
    assert ids.prompt_opens_reasoning(thinking.encode(QWEN_2507_PROMPT))
    assert not ids.prompt_opens_reasoning(thinking.encode(QWEN_NO_THINK_PROMPT))
    assert not ids.prompt_opens_reasoning(thinking.encode(QWEN_THINKING_PROMPT))


@pytest.mark.parametrize(("cls", "prompt", "text", "reasoning", "content"),
                         [c for c in CASES if "</think>" in c[2] or "<think>" not in c[2]])
def test_boundary_agrees_with_the_text_splitter(tokenizers, cls, prompt, text, reasoning,
                                                content):
    """Decoding the tokens after the boundary gives the splitter's content."""
    _, tok = tokenizers
    ids = think_token_ids(cls, tok)
    in_reasoning = cls.starts_in_reasoning(prompt)
    out = tok.encode(text, add_special_tokens=False)
    boundary = ReasoningBoundary(ids, in_reasoning)
    fed = [boundary.feed([t]) for t in out]          # one sampled token at a time
    start = content_start(out, ids, in_reasoning)
    assert (fed[-1] if fed else None) == start
    if start is None:
        assert content is None
        return
    assert all(f is None for f in fed[:max(start - 1, 0)])
    rest = tok.decode(out[start:], skip_special_tokens=False)
    if cls.split(text, prompt=prompt)[0] is None and not text.startswith("<think>"):
        assert rest == text                            # no reasoning: content from token 0
    else:
        assert (rest.lstrip() or None) == content


def test_boundary_first_token(tokenizers):
    _, tok = tokenizers
    ids = think_token_ids(Qwen3ReasoningParser, tok)
    b = ReasoningBoundary(ids, in_reasoning=False)
    assert b.first_token_extra() == ids.start       # a grammar must let the model think
    assert b.feed([ids.start]) is None and b.first_token_extra() is None
    assert b.feed(tok.encode("hm", add_special_tokens=False)) is None
    n = 1 + len(tok.encode("hm", add_special_tokens=False))
    assert b.feed([ids.end]) == n + 1 and b.ended
    b = ReasoningBoundary(ids, in_reasoning=False)
    assert b.feed(tok.encode("Hello", add_special_tokens=False)) == 0
    b = ReasoningBoundary(ids, in_reasoning=True)
    assert b.first_token_extra() is None
    assert b.feed([ids.end]) == 1
