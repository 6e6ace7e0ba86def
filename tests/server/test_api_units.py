"""Pure parts of the API layer: auth comparison, error mapping, log line, request ids,
model-name resolution."""

from __future__ import annotations

import pytest

from pagefleet.server.api.auth import key_matches
from pagefleet.server.api.errors import DRAINING_HEADER, to_api_error, validation_error
from pagefleet.server.api.protocol import CompletionRequest, sampling_params
from pagefleet.server.api.request_id import clean_request_id
from pagefleet.server.api.stats_log import Sample, is_idle, stats_line
from pagefleet.server.engine.async_engine import QueueFullError, QueueTimeoutError, ServerDrainingError
from pagefleet.server.engine.engine import PromptTooLongError
from pagefleet.server.models.hub import ModelNotFoundError, looks_like_repo_id, resolve_model


def test_key_matches():
    assert key_matches(b"Bearer s3cret", b"s3cret")
    assert key_matches(b"bearer s3cret", b"s3cret")
    for bad in (None, b"", b"s3cret", b"Bearer s3cre", b"Bearer s3cretX", b"Basic s3cret"):
        assert not key_matches(bad, b"s3cret")


def test_error_mapping():
    e = to_api_error(QueueFullError("full"))
    assert e.status == 429 and e.headers["Retry-After"] == "1"
    late = to_api_error(QueueTimeoutError("late"))
    assert late.status == 503 and late.headers["Retry-After"] == "1"
    assert DRAINING_HEADER not in late.headers          # busy, not going away
    drain = to_api_error(ServerDrainingError("the server is shutting down"))
    assert drain.status == 503 and drain.headers[DRAINING_HEADER] == "1"
    e = to_api_error(PromptTooLongError(4096, 1024, 4096))
    assert e.status == 400 and e.message.startswith(
        "This model's maximum context length is 4096 tokens. However, you requested 5120 "
        "tokens (4096 in the messages, 1024 in the completion).")
    assert e.param == "messages"
    # No max_tokens: the prompt alone fills the context (vLLM's other wording).
    e = to_api_error(PromptTooLongError(4096, None, 4096, "prompt"))
    assert e.message == ("This model's maximum context length is 4096 tokens. However, your "
                         "request has 4096 input tokens. Please reduce the length of the "
                         "input messages.") and e.param == "prompt"
    assert validation_error([{"loc": ("body", "prompt", "list[int]", 0), "msg": "bad",
                              "type": "int_type"}]).param == "prompt.0"


def test_generation_defaults_only_fill_unset_fields():
    defaults = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05}
    req = CompletionRequest(prompt="x", temperature=0.0)
    p = sampling_params(req, defaults, max_tokens=5, logprobs=None)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.top_p) == (0.0, 20, 1.05, 1.0)
    p = sampling_params(CompletionRequest(prompt="x"), {}, max_tokens=5, logprobs=None)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (1.0, -1, 1.0)


def test_stats_line_wording():
    a = Sample(0.0, 0, 0, 0, 0)
    b = Sample(10.0, 1000, 250, 400, 100)
    assert stats_line(a, b, 3, 2, 0.125) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 12.5%, "
        "Prefix cache hit rate: 25.0%")
    assert is_idle(a, Sample(10.0, 0, 0, 0, 0), 0, 0) and not is_idle(a, b, 0, 0)


def test_request_id_cleaning():
    assert clean_request_id("abc-123") == "abc-123"
    assert clean_request_id("a b\r\nX-Evil: 1") == "a_b__X-Evil:_1"
    assert len(clean_request_id("x" * 1000)) == 128


def test_model_resolution(tmp_path):
    assert looks_like_repo_id("Qwen/Qwen2.5-7B-Instruct")
    assert not looks_like_repo_id("./models/x") and not looks_like_repo_id("/abs/path")
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m")) == tmp_path / "m"
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "nope" / "deeper"))


def test_a_failed_stream_hands_out_its_text_before_the_error():
    """Tokens and a failure that reach the API in one core message: the text first,
    then the error (the stream's client saw the failure but lost the last tokens)."""
    import asyncio

    from pagefleet.server.engine.async_engine import RequestStream
    from pagefleet.server.engine.outputs import CompletionOutput, RequestOutput

    stream = RequestStream("r", 0.0, asyncio.Event())
    stream.push(RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [7, 8])], False))
    stream.error = ValueError("dead end")
    out = stream.take()
    assert out is not None and out.outputs[0].text == "ab"
    with pytest.raises(ValueError, match="dead end"):
        stream.take()


def test_every_refused_field_is_declared_where_it_is_refused():
    """The request models ignore undeclared fields: a table entry whose field is not
    declared on its model would never be refused, and the request would get a 200."""
    from pagefleet.server.api import protocol as P

    declared = P.CompletionRequest.model_fields.keys() | P.ChatCompletionRequest.model_fields.keys()
    assert not set(P.UNHONOURED_FIELDS) - declared
    assert not set(P.UNHONOURED_CHAT_FIELDS) - P.ChatCompletionRequest.model_fields.keys()
