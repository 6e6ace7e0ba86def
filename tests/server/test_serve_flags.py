"""`pagefleet serve` flags are checked once, at parse time: an out-of-range value is a
startup error that names the flag, never a server that misbehaves later (a zero stats
interval would spin the event loop; a zero queue cap would refuse every request)."""

from __future__ import annotations

import pytest

from pagefleet.server.cli import build_configs
from pagefleet.server.config import KEEP_ALIVE_TIMEOUT_S, ConfigError


@pytest.mark.parametrize("argv,flag,why", [
    (["--port", "70000"], "--port", "must be in 0..65535"),
    (["--max-num-queued-requests", "0"], "--max-num-queued-requests", "must be >= 1"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes", "must be >= 1"),
    (["--queue-timeout", "0"], "--queue-timeout", "must be > 0"),
    (["--request-body-timeout", "0"], "--request-body-timeout", "must be > 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout", "must be >= 0"),
    (["--max-log-len", "-1"], "--max-log-len", "must be >= 0"),
    (["--log-stats-interval", "0"], "--log-stats-interval", "must be > 0"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive", "must be > 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs", "must be >= 1"),
])
def test_out_of_range_flags_name_themselves(argv: list[str], flag: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_configs(["some/model", *argv])
    assert str(e.value) == f"{flag}: {why}"


def test_defaults_pass_and_keep_alive_outlives_the_usual_proxies() -> None:
    _, server, _ = build_configs(["some/model", "--shutdown-timeout", "0", "--port", "0"])
    assert server.timeout_keep_alive == KEEP_ALIVE_TIMEOUT_S > 60
    _, server, _ = build_configs(["some/model", "--timeout-keep-alive", "120"])
    assert server.timeout_keep_alive == 120


# -- vLLM launch lines and config files ----------------------------------------------------------
# A vLLM user's launch line or config file must start pagefleet with the same settings,
# or stop it with one line that names the flag and why; never a traceback, a 50-line
# usage block, or a setting silently read otherwise (review: /tmp/review/cli, 3/6/7/9/10).

def test_api_key_falls_back_to_vllms_variable() -> None:
    """The flag, then PAGEFLEET_API_KEY, then VLLM_API_KEY (a vLLM deployment injects
    its key there; ignoring it served without authentication)."""
    from pagefleet.server.api.serve import resolve_api_key

    both = {"PAGEFLEET_API_KEY": "ours", "VLLM_API_KEY": "theirs"}
    assert resolve_api_key("flag", both) == ("flag", "--api-key")
    assert resolve_api_key(None, both) == ("ours", "PAGEFLEET_API_KEY")
    assert resolve_api_key(None, {"VLLM_API_KEY": "theirs"}) == ("theirs", "VLLM_API_KEY")
    assert resolve_api_key(None, {"PAGEFLEET_API_KEY": "", "VLLM_API_KEY": "v"}) == ("v", "VLLM_API_KEY")
    assert resolve_api_key(None, {}) == (None, None)


def test_ipv6_hosts_are_logged_as_urls() -> None:
    from pagefleet.server.api.serve import http_url

    assert http_url("::", 8000) == "http://[::]:8000"
    assert http_url("::1", 1) == "http://[::1]:1"
    assert http_url("0.0.0.0", 8000) == "http://0.0.0.0:8000"
