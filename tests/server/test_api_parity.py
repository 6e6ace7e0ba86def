"""API parity with vLLM (issue 11) against a real server on loopback, with the official
`openai` client: tool calls (forced and streamed), structured outputs, reasoning
output, n / best_of, completion logprobs and echo, prompt logprobs, the metric
families. lm-evaluation-harness has its own test (test_lm_eval.py)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from pagefleet.server.chat_templates import TOOLS_CHAT_TEMPLATE
from tests.server.helpers_serve import ThreadServer, metric, wait_for

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_model(tiny_models):
    return tiny_models("qwen3-tools", arch="qwen3", chat_template=TOOLS_CHAT_TEMPLATE,
                       added_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def srv(tools_model):
    server = ThreadServer(tools_model, max_model_len=1024, max_num_seqs=16,
                          enable_auto_tool_choice=True, tool_call_parser="hermes",
                          enable_prompt_tokens_details=True,
                          served_model_name=["tiny", "tiny-alias"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- tools ------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_and_validate(client, choice):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=user("weather?"),
                                           tools=[WEATHER, TIME], tool_choice=choice,
                                           temperature=1.0, seed=seed, max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = c.message.tool_calls
        assert calls and all(call.id and call.type == "function" for call in calls)
        for call in calls:
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                schema["function"]["parameters"])


def test_streamed_tool_call_deltas_reassemble_into_the_message(client):
    kw = dict(model="tiny", messages=user("weather?"), tools=[WEATHER, TIME],
              tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=11,
              max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0].message
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "args": ""})
                call["id"] = call["id"] or d.id
                if d.function and d.function.name:
                    call["name"] += d.function.name
                if d.function and d.function.arguments:
                    call["args"] += d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    got = [(calls[i]["name"], calls[i]["args"]) for i in sorted(calls)]
    assert got == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_tools_reach_the_template_and_tool_results_round_trip(srv, client):
    with_tools = httpx.post(srv.url + "/tokenize", json={
        "messages": user("hi"), "tools": [WEATHER]}).json()
    plain = httpx.post(srv.url + "/tokenize", json={"messages": user("hi")}).json()
    history = user("weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                       max_tokens=5)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    rendered = httpx.post(srv.url + "/tokenize", json={
        "messages": history, "tools": [WEATHER], "return_token_strs": False}).json()
    assert rendered["count"] > with_tools["count"] > plain["count"]


def test_langchain_bind_tools(srv):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="tiny", base_url=srv.url + "/v1", api_key="unused",
                        temperature=1.0, max_tokens=200, seed=3, max_retries=0)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("weather?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])


def test_litellm_n_choices(srv, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network at import
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/tiny", api_base=srv.url + "/v1", api_key="unused",
                           messages=user("hi"), n=2, max_tokens=4, temperature=1.0)
    assert len(r.choices) == 2


# -- structured outputs ----------------------------------------------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima"]},
        "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
             "maxItems": 3}},
    "required": ["name", "role", "address", "tags"], "additionalProperties": False}


def test_json_schema_outputs_validate(client):
    async def many():
        c = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*[c.chat.completions.create(
            model="tiny", messages=user("a person"), temperature=1.0, seed=s, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}},
            # compact JSON: a random-weight model would wander in free whitespace
            extra_body={"structured_outputs": {"disable_any_whitespace": True}})
            for s in range(20)])
    for r in asyncio.run(many()):
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_regex_and_choice(srv):
    for s in range(4):
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": s,
            "structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{3}"}}).json()
        assert re.fullmatch("[a-c]{2,5}-[0-9]{3}", r["choices"][0]["text"]), r
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": user("pick"), "max_tokens": 20, "temperature": 1.0, "seed": s,
            "structured_outputs": {"choice": ["red alert", "green", "blue sky"]}}).json()
        assert r["choices"][0]["message"]["content"] in ("red alert", "green", "blue sky")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
])
def test_invalid_constraints_are_400(srv, body, param):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": user("x"), "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param.split(".")[0]), r.text


BAD = {"type": "function", "function": {"name": "broken", "parameters": {"type": "bogus"}}}


@pytest.mark.parametrize("tools,choice,param", [
    ([BAD], {"type": "function", "function": {"name": "broken"}}, "tools.0.function.parameters"),
    ([WEATHER, BAD], "required", "tools.1.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string", "minLength": 5, "maxLength": 2}}}],
     {"type": "function", "function": {"name": "f"}}, "tools.0.function.parameters"),
])
def test_forced_tool_call_with_a_bad_schema_is_400(srv, tools, choice, param):
    """A forced call's schema becomes the grammar: checked as response_format's is (it
    reached the compiler and came back a 500)."""
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": user("x"), "max_tokens": 8, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # a bad schema of a tool that cannot be called does not matter
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": user("x"), "max_tokens": 8, "tools": [WEATHER, BAD],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text


def test_a_grammar_with_no_way_on_is_a_400_and_the_server_goes_on(srv):
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 8, "guided_regex": r"[^\s\S]"})
    assert r.status_code == 400, r.text
    assert "allows no token after 0 generated tokens" in r.json()["error"]["message"]
    # a dead end after two forced tokens: the stream has begun, the error comes in-band
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 8, "stream": True,
            "guided_regex": r"ab[^\s\S]"}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    errors = [json.loads(ln[6:])["error"] for ln in lines if '"error"' in ln]
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
    assert errors and errors[0]["code"] == 400, lines
    text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines
                   if ln.startswith("data: {") and '"choices"' in ln)
    assert text == "ab"
    wait_for(lambda: metric(httpx.get(srv.url + "/metrics").text,
                            "vllm:num_requests_running") == 0)
    ok = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")


def test_min_tokens_yields_to_the_grammar_end(srv):
    """min_tokens keeps EOS out while the finished grammar allows only EOS: the grammar
    wins (it was a 500)."""
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 20, "min_tokens": 10, "guided_choice": ["a", "b"]})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"] in ("a", "b") and ch["finish_reason"] == "stop"


# -- n / best_of -----------------------------------------------------------------------------
def test_n_shares_the_first_choice_with_n1_and_best_of_picks_the_likeliest(srv):
    body = {"prompt": "hello world", "max_tokens": 12, "temperature": 1.0, "seed": 42,
            "ignore_eos": True}
    one = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    three = httpx.post(srv.url + "/v1/completions", json={**body, "n": 3}, timeout=60).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["choices"][0]["text"] == one["choices"][0]["text"]
    assert len({c["text"] for c in three["choices"]}) > 1
    assert three["usage"]["completion_tokens"] == 36
    cands = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        **body, "n": 3, "logprobs": 0}).json()["choices"]
    total = [sum(c["logprobs"]["token_logprobs"]) for c in cands]
    best = httpx.post(srv.url + "/v1/completions", json={**body, "best_of": 3, "n": 1},
                      timeout=60).json()
    assert len(best["choices"]) == 1
    assert best["choices"][0]["text"] == cands[total.index(max(total))]["text"]
    assert best["usage"]["completion_tokens"] == 36
    chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": user("hi"), "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 1,
        "stream": True}).text
    indices = {json.loads(line[6:])["choices"][0]["index"] for line in chat.splitlines()
               if line.startswith("data: {") and json.loads(line[6:])["choices"]}
    assert indices == {0, 1}


# -- logprobs, echo, prompt logprobs ------------------------------------------------------------
def test_completion_logprobs_echo_and_prompt_logprobs(srv, client):
    r = client.completions.create(model="tiny", prompt="hello world the model", max_tokens=3,
                                  logprobs=2, echo=True, temperature=0,
                                  extra_body={"repetition_penalty": 1.0})   # plain greedy
    c = r.choices[0]
    prompt_ids = httpx.post(srv.url + "/tokenize", json={"prompt": "hello world the model",
                                                         "add_special_tokens": False}).json()
    n_prompt = prompt_ids["count"]
    lp = c.logprobs
    assert c.text.startswith("hello world the model")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for tok_lp, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert tok_lp == pytest.approx(max(top.values()))    # greedy: the top one
    raw = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "hello world the model", "max_tokens": 2, "prompt_logprobs": 1,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": 1}).json()
    ch = raw["choices"][0]
    assert len(ch["prompt_logprobs"]) == n_prompt and ch["prompt_logprobs"][0] is None
    assert ch["prompt_token_ids"] == prompt_ids["tokens"] and len(ch["token_ids"]) == 2
    assert all(t.startswith("token_id:") for t in ch["logprobs"]["tokens"])
    # echo's prompt logprobs equal prompt_logprobs' for the same tokens
    first = ch["prompt_logprobs"][1][str(prompt_ids["tokens"][1])]["logprob"]
    assert first == pytest.approx(lp.token_logprobs[1], abs=1e-5)


def completions(srv, **body) -> dict:
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_chunks(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(srv):
    """vLLM's prompt-scoring call: the prompt and its logprobs, nothing generated."""
    prompt = "hello world the model"
    full = completions(srv, prompt=prompt, max_tokens=3, echo=True, logprobs=1)["choices"][0]
    r = completions(srv, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                    return_token_ids=True)
    ch = r["choices"][0]
    n_prompt = len(ch["prompt_token_ids"])
    assert ch["text"] == prompt and ch["token_ids"] == []
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == n_prompt
    lp = ch["logprobs"]
    assert lp["tokens"] == full["logprobs"]["tokens"][:n_prompt]
    assert lp["token_logprobs"] == full["logprobs"]["token_logprobs"][:n_prompt]
    streamed = sse_chunks(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 0,
                                                   "echo": True, "logprobs": 1})
    assert "".join(c["choices"][0]["text"] for c in streamed) == prompt
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in streamed), []) == lp["tokens"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_leads_with_the_prompt_logprobs(srv):
    body = {"prompt": "hello world the model", "max_tokens": 3, "echo": True, "logprobs": 2,
            "temperature": 0, "ignore_eos": True}
    whole = completions(srv, **body)["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in sse_chunks(srv, "/v1/completions", body)]
    assert sum((c["tokens"] for c in chunks), []) == whole["tokens"]
    assert sum((c["token_logprobs"] for c in chunks), []) == whole["token_logprobs"]


def test_logprobs_0_names_the_sampled_token(srv):
    """`logprobs: 0` (and every N) lists the chosen token first, as vLLM does."""
    for n in (0, 2):
        lp = completions(srv, prompt="hello world", max_tokens=4, logprobs=n,
                         ignore_eos=True)["choices"][0]["logprobs"]
        for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert next(iter(top)) == tok and top[tok] == chosen
            assert len(top) in (max(n, 1), n + 1)


def test_prompt_logprobs_rank_is_the_vocabulary_rank(srv):
    """A prompt token's rank does not depend on how many top logprobs come with it, and
    the top-N tokens are ranked 1..N (random prompt tokens mostly lie outside them)."""
    prompt = "zebra quantum hello lantern model of the banana"
    by_n = {}
    for n in (1, 5):
        ch = completions(srv, prompt=prompt, max_tokens=1, prompt_logprobs=n,
                         return_token_ids=True)["choices"][0]
        by_n[n] = [None if d is None else d[str(t)]["rank"]
                   for t, d in zip(ch["prompt_token_ids"], ch["prompt_logprobs"])]
        for t, d in zip(ch["prompt_token_ids"][1:], ch["prompt_logprobs"][1:]):
            others = sorted(v["rank"] for k, v in d.items() if k != str(t))
            assert others == list(range(1, n + 1)) or d[str(t)]["rank"] <= n
    assert by_n[1] == by_n[5]
    assert any(r is not None and r > 5 for r in by_n[1])   # outside the top: the true rank


def test_continuous_usage_needs_include_usage(srv):
    body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    off = sse_chunks(srv, "/v1/completions", {**body, "stream_options": {
        "continuous_usage_stats": True}})
    assert off and all("usage" not in c for c in off)
    on = sse_chunks(srv, "/v1/completions", {**body, "stream_options": {
        "continuous_usage_stats": True, "include_usage": True}})
    assert all("usage" in c for c in on)


def test_chat_template_kwargs_override_the_request_fields(srv):
    def prompt_tokens(**kw) -> int:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": user("hi"), "max_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens(chat_template_kwargs={"add_generation_prompt": False}) == \
        prompt_tokens(add_generation_prompt=False) < prompt_tokens()
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": user("hi"), "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_truncate_prompt_tokens_and_cached_tokens_detail(srv):
    long = "hello world the model " * 20
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10}).json()
    assert r["usage"]["prompt_tokens"] == 10
    httpx.post(srv.url + "/v1/completions", json={"prompt": long, "max_tokens": 1}, timeout=60)
    again = httpx.post(srv.url + "/v1/completions", json={"prompt": long, "max_tokens": 1},
                       timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


# -- names, endpoints --------------------------------------------------------------------------
def test_aliases_models_and_ping(srv, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    r = client.completions.create(model="tiny-alias", prompt="x", max_tokens=2)
    assert r.model == "tiny"      # the first name is the one reported
    assert httpx.get(srv.url + "/ping").status_code == 200
    assert httpx.post(srv.url + "/ping").status_code == 200
    assert httpx.get(srv.url + "/openapi.json").json()["paths"]["/v1/chat/completions"]
    assert httpx.get(srv.url + "/docs").status_code == 200


# -- metrics ----------------------------------------------------------------------------------------
def test_vllm_metric_families_move(srv):
    before = srv.metrics()
    httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": "hello world", "max_tokens": 7, "ignore_eos": True, "n": 2, "temperature": 1})
    wait_for(lambda: metric(srv.metrics(), "vllm:request_generation_tokens_count") >=
             metric(before, "vllm:request_generation_tokens_count") + 2, 30)
    after = srv.metrics()

    def moved(name, by=None, **labels):
        d = metric(after, name, **labels) - metric(before, name, **labels)
        assert d > 0 if by is None else d == pytest.approx(by), (name, d)
    moved("vllm:iteration_tokens_total_count")
    moved("vllm:request_prompt_tokens_count", 2)
    moved("vllm:request_generation_tokens_sum", 14)
    moved("vllm:request_params_n_sum", 2)
    moved("vllm:request_params_max_tokens_sum", 7)
    for name in ("vllm:request_inference_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count"):
        moved(name, 2)


# -- reasoning ------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_content_split_streamed_and_not(tools_model, parser):
    """The model's output is forced (a choice constraint: the history closes a think
    block, so the grammar holds from the first token) to contain a think block."""
    server = ThreadServer(tools_model, max_model_len=512, reasoning_parser=parser).start()
    try:
        forced = "<think>plan it</think>the answer" if parser == "qwen3" else \
            "plan it</think>the answer"
        body = {"messages": [{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "<think>x</think>y"},
                             {"role": "user", "content": "again"}],
                "max_tokens": 40, "temperature": 1.0,
                "structured_outputs": {"choice": [forced]}}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        msg = r["choices"][0]["message"]
        assert msg["reasoning_content"] == "plan it" and msg["content"] == "the answer", msg
        text = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60).text
        reasoning = content = ""
        for line in text.splitlines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:])["choices"]:
                reasoning += ch["delta"].get("reasoning_content") or ""
                content += ch["delta"].get("content") or ""
        assert (reasoning, content) == ("plan it", "the answer")
    finally:
        server.stop()
