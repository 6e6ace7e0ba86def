"""The built-in demo model (issue 16): the shipped checkpoint loads, its chat template
renders system/user/assistant turns and hermes-style tools, and its replies, greedy,
sampled and streamed through the real server, are printable English with no U+FFFD."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from pagefleet.server.demo import DEMO_DIR
from pagefleet.server.demo.corpus import WEATHER_TOOL
from pagefleet.server.models.config import ModelConfig, generation_defaults
from pagefleet.server.testing import demo_model_path
from tests.server.helpers import hf_greedy
from tests.server.helpers_serve import ThreadServer

FFFD = "\ufffd"


def printable(text: str) -> bool:
    return all(ch.isprintable() or ch == "\n" for ch in text) and FFFD not in text


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_path()))


@pytest.fixture(scope="module")
def llm():
    from pagefleet.server import LLM

    return LLM(str(demo_model_path()), max_model_len=1024, max_num_seqs=8)


def chat_prompt(tok, messages, tools=None) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def test_checkpoint_is_shipped_and_loads():
    path = demo_model_path()
    assert path == DEMO_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (path / name).is_file(), name
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.tie_word_embeddings and cfg.qk_norm
    assert 1_000_000 < (path / "model.safetensors").stat().st_size < 20_000_000
    gen = generation_defaults(path)
    assert 0 < gen["temperature"] < 1 and 0 < gen["top_p"] <= 1 and gen["top_k"] > 0
    im_end = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert im_end in cfg.eos_token_ids


def test_template_renders_system_user_assistant(tok):
    text = tok.apply_chat_template(
        [{"role": "system", "content": "You are Ada."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Ada.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_template_renders_tools_calls_and_responses(tok):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": '{"temperature": 18}'},
         {"role": "tool", "content": '{"condition": "sunny"}'}],
        tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in system
    assert "<tool_call></tool_call> XML tags" in system
    assert rest == ('<|im_start|>user\nWeather in Paris?<|im_end|>\n'
                    '<|im_start|>assistant\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
                    '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response>\n'
                    '<tool_response>\n{"condition": "sunny"}\n</tool_response><|im_end|>\n'
                    '<|im_start|>assistant\n')
    # Without a system message the tools still get a system turn of their own.
    bare = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL],
                                   tokenize=False)
    assert bare.startswith("<|im_start|>system\n# Tools\n")
    # The tool tags are whole tokens that skip_special_tokens keeps.
    ids = tok.encode("<tool_call>\n</tool_call>", add_special_tokens=False)
    assert len(ids) == 3 and tok.decode(ids, skip_special_tokens=True) == "<tool_call>\n</tool_call>"


PROMPTS = ["Hello, who are you?", "What is pagefleet?", "Tell me a story about a fox.",
           "What is the capital of Japan?", "How do you say hello in Japanese?",
           "Can you fix my car?"]


def test_greedy_replies_are_english_sentences(llm, tok):
    from pagefleet.server import SamplingParams

    prompts = [chat_prompt(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96))
    replies = {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}
    for p, out in replies.items():
        assert out.finish_reason == "stop", (p, out.text)
        assert printable(out.text) and out.text[:1].isupper() and out.text.rstrip()[-1] in ".!?", \
            (p, out.text)
    assert "demo model" in replies["Hello, who are you?"].text
    assert "Tokyo" in replies["What is the capital of Japan?"].text
    assert "こんにちは" in replies["How do you say hello in Japanese?"].text


def test_sampled_replies_are_printable(llm, tok):
    from pagefleet.server import SamplingParams

    prompt = chat_prompt(tok, [{"role": "user", "content": "Tell me a story."}])
    outs = llm.generate([prompt] * 4, [SamplingParams(seed=s, max_tokens=128, **llm.engine.generation_defaults)
                                       for s in range(4)])
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts)) > 1          # sampling really samples
    for t in texts:
        assert printable(t) and len(t.split()) > 10, t


def test_tool_call_when_the_request_offers_the_tool(llm, tok):
    from pagefleet.server import SamplingParams

    prompt = chat_prompt(tok, [{"role": "user", "content": "What is the weather in Paris?"}],
                         tools=[WEATHER_TOOL])
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64,
                                                 skip_special_tokens=True))[0].outputs[0].text
    assert text.startswith("<tool_call>\n") and text.endswith("</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_greedy_equals_hf_transformers(llm, tok):
    from pagefleet.server import SamplingParams

    ids = tok.encode(chat_prompt(tok, [{"role": "user", "content": "Who are you?"}]),
                     add_special_tokens=False)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert ours[0].outputs[0].token_ids == hf_greedy(demo_model_path(), [ids], [24])[0]


@pytest.fixture(scope="module")
def srv():
    server = ThreadServer(demo_model_path(), served_model_name="pagefleet-demo",
                          max_num_seqs=4).start()
    yield server
    server.stop()


def test_streamed_chunks_carry_whole_characters(srv):
    client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    for question in ("How do you say hello in Japanese?", "How do you say hello in Korean?",
                     "Hello, who are you?"):
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="pagefleet-demo", stream=True, temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": question}]) if c.choices]
        text = "".join(chunks)
        assert all(printable(c) for c in chunks), chunks
        assert text and text.rstrip()[-1] in ".!?", text
