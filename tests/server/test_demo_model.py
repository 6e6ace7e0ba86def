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
           "What is the capital of Brazil?", "Do you speak other languages?",
           "Can you fix my car?"]


def sentence_like(text: str) -> bool:
    return printable(text) and text[:1].isalpha() and text.rstrip()[-1:] in (".", "!", "?", ")") \
        and len(text.split()) >= 4


def test_greedy_replies_are_english_sentences(llm, tok):
    from pagefleet.server import SamplingParams

    prompts = [chat_prompt(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96))
    replies = {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}
    for p, out in replies.items():
        assert out.finish_reason == "stop" and sentence_like(out.text), (p, out.text)
    assert "demo model" in replies["Hello, who are you?"].text
    assert "pagefleet" in replies["What is pagefleet?"].text
    assert "fox" in replies["Tell me a story about a fox."].text
    # Multi-byte characters, streamed token by token, come out whole.
    assert any(ord(ch) > 127 for p in PROMPTS[3:5] for ch in replies[p].text)


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
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "get_weather" and list(call["arguments"]) == ["city"], call
    assert isinstance(call["arguments"]["city"], str) and call["arguments"]["city"]


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
    for question in ("Do you speak other languages?", "What is the capital of Brazil?",
                     "Hello, who are you?"):
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="pagefleet-demo", stream=True, temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": question}]) if c.choices]
        text = "".join(chunks)
        assert all(printable(c) for c in chunks), chunks
        assert sentence_like(text), text


def test_wheel_and_sdist_carry_the_checkpoint(tmp_path):
    """Built with setuptools' PEP 517 backend from a copy of the sources (so the worktree
    gets no build/ or egg-info): both archives hold every checkpoint file."""
    import shutil
    import subprocess
    import sys
    import tarfile
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("server", "operator"):
        shutil.copytree(root / name, src / name, ignore=ignore)
    dist = tmp_path / "dist"
    for kind in ("sdist", "wheel"):      # one build per process: setuptools keeps state
        (dist / kind).mkdir(parents=True)
        done = subprocess.run(
            [sys.executable, "-c", f"from setuptools import build_meta as b; import sys; "
             f"b.build_{kind}(sys.argv[1])", str(dist / kind)],
            cwd=src, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    shipped = sorted(p.name for p in DEMO_DIR.iterdir() if p.is_file())
    assert "model.safetensors" in shipped
    wheel = zipfile.ZipFile(next(dist.glob("wheel/*.whl")))
    in_wheel = sorted(n.rsplit("/", 1)[1] for n in wheel.namelist()
                      if n.startswith("pagefleet/server/demo/model/"))
    with tarfile.open(next(dist.glob("sdist/*.tar.gz"))) as sdist:
        in_sdist = sorted(n.rsplit("/", 1)[1] for n in sdist.getnames()
                          if "/server/demo/model/" in n)
    assert in_wheel == shipped and in_sdist == shipped


def test_documented_greedy_replies_are_the_models(llm, tok):
    """docs/demo.md shows real replies: every greedy reply in its samples table (plain
    questions) and the Kubernetes example's reply to "Hello" are what the shipped
    checkpoint answers at temperature 0."""
    import re
    from pathlib import Path

    from pagefleet.server import SamplingParams

    doc = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text()
    table = doc[doc.index("## Sample replies"):doc.index("## On Kubernetes")]
    expected = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "(" not in cells[0] and cells[0] not in ("question", "---"):
            expected[cells[0]] = cells[1]
    k8s = doc[doc.index("## On Kubernetes"):]
    expected["Hello"] = re.search(r"`\"temperature\": 0`:\n\n```\n(.*?)\n```", k8s, re.S).group(1)
    assert len(expected) >= 8, expected
    questions = list(expected)
    prompts = [chat_prompt(tok, [{"role": "user", "content": q}]) for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=160))
    got = {q: o.outputs[0].text.strip() for q, o in zip(questions, outs)}
    assert got == expected
