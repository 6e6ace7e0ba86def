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
def srv(tools_model):
    server = ThreadServer(tools_model, max_model_len=1024, max_num_seqs=16,
                          enable_auto_tool_choice=True, tool_call_parser="hermes",
                          enable_prompt_tokens_details=True, trust_request_chat_template=True,
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
def _reasoning_server(tools_model, parser: str):
    server = ThreadServer(tools_model, max_model_len=1024, enable_auto_tool_choice=True,
                          tool_call_parser="hermes", reasoning_parser=parser).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3_srv(tools_model):
    yield from _reasoning_server(tools_model, "qwen3")


@pytest.fixture(scope="module")
def r1_srv(tools_model):
    yield from _reasoning_server(tools_model, "deepseek_r1")


def think_ids(server) -> tuple[int, int]:
    ids = []
    for tag in ("<think>", "</think>"):
        r = httpx.post(server.url + "/tokenize", json={"prompt": tag,
                                                       "add_special_tokens": False}).json()
        assert r["count"] == 1, r
        ids.append(r["tokens"][0])
    return ids[0], ids[1]


def chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"max_tokens": 24, "temperature": 1.0, "seed": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, **body) -> dict:
    """The streamed message's (reasoning, content, finish_reason) and every delta key."""
    text = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "max_tokens": 24, "temperature": 1.0, "seed": 0, "stream": True, **body}).text
    out = {"reasoning_content": "", "content": "", "keys": set(), "finish": None}
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:])["choices"]:
            out["keys"] |= set(ch["delta"])
            out["reasoning_content"] += ch["delta"].get("reasoning_content") or ""
            out["content"] += ch["delta"].get("content") or ""
            out["finish"] = ch["finish_reason"] or out["finish"]
    return out


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_content_split_streamed_and_not(qwen3_srv, r1_srv, parser):
    """The model is steered by logit_bias: qwen3 (the prompt opens no think block, so
    the first token decides) writes <think> then </think>; deepseek_r1 (starts inside)
    writes </think>; after it the choice constraint holds the answer."""
    server = qwen3_srv if parser == "qwen3" else r1_srv
    think, end = think_ids(server)
    bias = {str(think): 50, str(end): 100} if parser == "qwen3" else {str(end): 100}
    body = {"messages": user("q"), "max_tokens": 40, "logit_bias": bias,
            "structured_outputs": {"choice": ["the answer"]}}
    msg = chat(server, **body)["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] == "the answer", msg
    s = streamed(server, **body)
    assert (s["reasoning_content"], s["content"]) == ("", "the answer")


W_REQUIRED = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
CONSTRAINTS = {
    "regex": {"structured_outputs": {"regex": "[0-9]{3}"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]}}}},
    "required": W_REQUIRED,
    "named": {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                   "function": {"name": "get_weather"}}},
}


def check_constrained(kind: str, choice: dict) -> None:
    msg = choice["message"]
    assert msg["reasoning_content"] is None, msg
    if kind == "regex":
        assert re.fullmatch(r"[0-9]{3}", msg["content"] or ""), msg
    elif kind == "json_schema":
        assert isinstance(json.loads(msg["content"])["a"], int), msg
    else:
        assert msg["content"] is None and choice["finish_reason"] == "tool_calls", choice
        for call in msg["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                WEATHER["function"]["parameters"])


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_qwen3_grammar_holds_when_the_model_does_not_think(qwen3_srv, kind):
    """Review finding 2: the prompt opens no think block and the model's first token is
    not <think> (banned here, so the check does not depend on the model's whim): the
    answer is under the grammar from its first token (it used to be unconstrained)."""
    think, _ = think_ids(qwen3_srv)
    body = {"messages": user("What's the weather in Paris?"), "max_tokens": 200,
            "logit_bias": {str(think): -100}, **CONSTRAINTS[kind]}
    for seed in range(2):
        check_constrained(kind, chat(qwen3_srv, seed=seed, **body)["choices"][0])
    if kind == "regex":
        s = streamed(qwen3_srv, **body)
        assert re.fullmatch(r"[0-9]{3}", s["content"]) and not s["reasoning_content"], s


def test_qwen3_model_that_thinks_first_then_answers_under_the_grammar(qwen3_srv):
    """The undecided first step allows <think> beside the grammar's tokens: a model
    that opens a think block may think (no grammar there), and the answer after
    </think> is held; the text splitter agrees on where it starts."""
    think, end = think_ids(qwen3_srv)
    r = chat(qwen3_srv, messages=user("q"), logit_bias={str(think): 50, str(end): 100},
             structured_outputs={"regex": "[0-9]{3}"}, return_token_ids=True)
    c = r["choices"][0]
    assert c["token_ids"][:2] == [think, end], c
    assert re.fullmatch(r"[0-9]{3}", c["message"]["content"]), c
    assert c["message"]["reasoning_content"] is None


@pytest.mark.parametrize("kind", ["regex", "named", "required"])
def test_deepseek_r1_prompt_that_closed_the_think_block_is_content(r1_srv, kind):
    """Review finding 3: with enable_thinking false the template closes the think block
    in the prompt; the engine holds the grammar from the first token and the splitter
    must call that output content (it was all reasoning, and the call's arguments "")."""
    think, _ = think_ids(r1_srv)
    body = {"messages": user("What's the weather in Paris?"), "max_tokens": 200,
            "chat_template_kwargs": {"enable_thinking": False},
            "logit_bias": {str(think): -100}, **CONSTRAINTS[kind]}
    check_constrained(kind, chat(r1_srv, **body)["choices"][0])
    # with no closed block in the prompt, R1's output starts inside (vLLM's rule):
    # a cut-off output is all reasoning
    msg = chat(r1_srv, messages=user("hi"), max_tokens=6)["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] is None, msg


def test_include_reasoning_false_leaves_the_reasoning_out(r1_srv):
    """Review finding 4: vLLM's include_reasoning; the output starts inside the
    reasoning (R1) and is cut short, so it is all reasoning."""
    body = {"messages": user("hi"), "max_tokens": 6}
    msg = chat(r1_srv, **body)["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    hidden = chat(r1_srv, include_reasoning=False, **body)["choices"][0]["message"]
    assert "reasoning_content" not in hidden and "reasoning" not in hidden, hidden
    assert hidden["content"] is None
    s = streamed(r1_srv, include_reasoning=False, **body)
    assert not s["keys"] & {"reasoning_content", "reasoning"} and s["finish"] == "length", s
    shown = streamed(r1_srv, **body)
    assert shown["reasoning_content"] == msg["reasoning_content"]


# -- request fields vLLM honours (review findings 1, 5, 6, 8, 9) ----------------------------
def test_request_chat_template_needs_the_trust_flag(srv, qwen3_srv):
    """vLLM's --trust-request-chat-template: without it a request's template is a 400
    (it was silently ignored); with it the prompt is rendered by that template."""
    body = {"messages": user("hi"), "max_tokens": 1, "chat_template": '{{ "Xy" }}',
            "return_token_ids": True}
    r = httpx.post(qwen3_srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    r = httpx.post(qwen3_srv.url + "/tokenize", json={"messages": user("hi"),
                                                      "chat_template": '{{ "Xy" }}'})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    ids = chat(srv, **body)["prompt_token_ids"]
    assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "Xy"
    r = httpx.post(srv.url + "/tokenize", json={"messages": user("hi"),
                                                "chat_template": '{{ "Xy" }}'}).json()
    assert r["tokens"] == ids


def test_documents_reach_the_template(srv):
    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{{ messages[-1].content }}")
    ids = chat(srv, messages=user("hi"), max_tokens=1, chat_template=template,
               return_token_ids=True,
               documents=[{"title": "t", "text": "a long document"}])["prompt_token_ids"]
    text = httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "[t: a long document]hi"
    # /tokenize counts what chat prompts with, documents included
    r = httpx.post(srv.url + "/tokenize", json={
        "messages": user("hi"), "chat_template": template,
        "documents": [{"title": "t", "text": "a long document"}]}).json()
    assert r["tokens"] == ids


def test_history_tool_call_arguments_reach_the_template_as_an_object(srv):
    """Review finding 1, through the server: a Qwen3-Coder-style template iterates the
    arguments (`| items`); it was a 400 with the arguments left a JSON string."""
    template = ("{%- for m in messages -%}{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
                "<function={{ tc.function.name }}>{%- for k, v in tc.function.arguments|items -%}"
                "<parameter={{ k }}>{{ v }}</parameter>{%- endfor -%}</function>"
                "{%- endfor -%}{%- else -%}{{ m.content }}{%- endif -%}|{%- endfor -%}")
    history = user("weather?") + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    ids = chat(srv, messages=history, max_tokens=1, chat_template=template,
               return_token_ids=True)["prompt_token_ids"]
    text = httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "weather?|<function=get_weather><parameter=city>Paris</parameter></function>|21C|"
    history[1]["tool_calls"][0]["function"]["arguments"] = '{"city": '
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": history, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"


def test_chat_logprobs_return_tokens_as_token_ids(srv):
    """Review finding 6: as on /v1/completions, tokens are written token_id:<id>."""
    c = chat(srv, messages=user("hi"), max_tokens=3, logprobs=True, top_logprobs=2,
             return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    entries = c["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    s = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": user("hi"), "max_tokens": 3, "logprobs": True, "stream": True,
        "return_tokens_as_token_ids": True}).text
    tokens = [e["token"] for line in s.splitlines() if line.startswith("data: {")
              for ch in json.loads(line[6:])["choices"]
              for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def test_required_call_cut_by_max_tokens_has_no_content(srv, client):
    """Review finding 8: pieces of the forced JSON (`, `, `[{"na`) are not content."""
    for max_tokens in (2, 5, 9, 14, 20, 27):
        kw = dict(model="tiny", messages=user("weather?"), tools=[WEATHER, TIME],
                  tool_choice="required", temperature=1.0, seed=max_tokens,
                  max_tokens=max_tokens)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.message.content is None, (max_tokens, c)
        assert c.finish_reason in ("length", "tool_calls")
        content = "".join(ch.choices[0].delta.content or ""
                          for ch in client.chat.completions.create(stream=True, **kw)
                          if ch.choices)
        assert content == "", (max_tokens, content)


def test_required_with_no_tools_is_none(client):
    """Review finding 9: vLLM (and OpenAI) treat `tools: []` with "required" as "none"."""
    r = client.chat.completions.create(model="tiny", messages=user("hi"), tools=[],
                                       tool_choice="required", max_tokens=3)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("length", "stop")
