"""`/v1/responses` through the real gateway: relayed like chat (the official client's
responses.create and its stream), routed by the prompt the server will render (the
mapped chat messages: context fit picks the pool), refused fields are the servers'
400s, and the API key covers it."""

from __future__ import annotations

import httpx
import openai
import yaml

from tests.gateway.helpers import GatewayThread, metric, models_yaml

WORDS = "model token cache block batch queue request server memory prefix chunk".split()


def ep(b) -> dict:
    return {"name": b.name, "url": b.url}


def test_responses_relay_route_by_the_rendered_input_and_stream(backends, tmp_path, gw_model):
    short, long_ = backends["short-0"], backends["long-0"]
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "tokenizer": str(gw_model), "pools": [
        {"name": "short", "max_model_len": 256, "endpoints": [ep(short)]},
        {"name": "long", "max_model_len": 1024, "endpoints": [ep(long_)]}]}])
    gw = GatewayThread(f).start()
    try:
        gw.wait_ready_endpoints("tiny", 2)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=short.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny", instructions="Be brief.", input="What is a block?",
                  max_output_tokens=8, temperature=0)
        raw = client.responses.with_raw_response.create(**kw)
        assert raw.headers["x-pagefleet-endpoint"] == "short-0"
        r = raw.parse()
        assert r.output_text == direct.responses.create(**kw).output_text
        events = list(client.responses.create(stream=True, **kw))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == r.output_text

        # A long input (the rendered messages, instructions included) only fits the
        # long pool: the gateway rendered the mapped chat prompt to decide.
        before = metric(long_.metrics(), "vllm:prompt_tokens_total")
        items = [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": " ".join(WORDS * 30)}]}]
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            long_r = c.post("/v1/responses", json={"model": "tiny", "input": items,
                                                   "max_output_tokens": 4})
            assert long_r.status_code == 200, long_r.text
            assert long_r.headers["x-pagefleet-endpoint"] == "long-0"
            used = long_r.json()["usage"]["input_tokens"]
            assert metric(long_.metrics(), "vllm:prompt_tokens_total") - before == used > 256
            # No pool holds it: the gateway's 400 names the field as the server does.
            too_long = {"model": "tiny", "input": " ".join(WORDS * 200), "max_output_tokens": 4}
            r = c.post("/v1/responses", json=too_long)
            direct_r = httpx.post(long_.url + "/v1/responses", json=too_long, timeout=120)
            assert r.status_code == direct_r.status_code == 400, r.text
            assert r.json()["error"]["param"] == direct_r.json()["error"]["param"] == "input"
            refused = c.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                                    "previous_response_id": "resp_1"})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "previous_response_id"
    finally:
        gw.stop()


def test_responses_needs_a_key_with_an_api_keys_file(backends, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"key": "sk-a", "name": "a"}]}))
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [
        {"name": "p", "endpoints": [ep(backends["short-1"])]}]}])
    gw = GatewayThread(f, api_keys_file=str(keys)).start()
    try:
        gw.wait_ready_endpoints("tiny", 1)
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            assert c.post("/v1/responses", json=body).status_code == 401
            ok = c.post("/v1/responses", json=body, headers={"Authorization": "Bearer sk-a"})
            assert ok.status_code == 200, ok.text
            assert ok.json()["object"] == "response"
    finally:
        gw.stop()
