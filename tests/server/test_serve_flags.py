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


def test_quantization_takes_vllms_method_names() -> None:
    """vLLM's names for the formats served here, compressed-tensors (llm-compressor)
    included; whether one fits the checkpoint is checked when it is read."""
    for name in ("fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors"):
        engine, _, _ = build_configs(["some/model", "--quantization", name])
        assert engine.quantization == name
    with pytest.raises((ConfigError, SystemExit)):
        build_configs(["some/model", "--quantization", "bitsandbytes"])


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


@pytest.mark.parametrize("value,tokens", [
    ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 1_000_000), ("1M", 1 << 20),
    (" 4k ", 4000),
])
def test_token_counts_take_vllms_suffixes(value: str, tokens: int) -> None:
    engine, _, _ = build_configs(["m", "--max-model-len", value,
                                  "--max-num-batched-tokens", value])
    assert engine.max_model_len == engine.max_num_batched_tokens == tokens


def test_suffix_errors_are_vllms_and_short(capsys: pytest.CaptureFixture[str]) -> None:
    engine, _, _ = build_configs(["m", "--kv-cache-memory", "512M"])
    assert engine.kv_cache_memory == 512 << 20
    for bad, why in (("1.5K", "did you mean 1.5k"), ("32x", "expected a whole number")):
        with pytest.raises(SystemExit):
            build_configs(["m", "--max-model-len", bad])
        err = capsys.readouterr().err
        assert f"argument --max-model-len: invalid value '{bad}'" in err and why in err
        assert "usage:" not in err and len(err.splitlines()) == 2, err


IGNORED_VLLM_LINES = [
    ["--max-parallel-loading-workers", "4"], ["--use-v2-block-manager"],
    ["--num-scheduler-steps", "8"], ["--disable-frontend-multiprocessing"],
    ["--tokenizer-mode", "auto"], ["--tokenizer-mode=hf"], ["--max-seq-len-to-capture", "8192"],
    ["--preemption-mode", "recompute"], ["--preemption-mode", "swap"],
    ["--disable-sliding-window"], ["--load-format", "safetensors"],
]


@pytest.mark.parametrize("extra", IGNORED_VLLM_LINES)
def test_vllm_flags_that_change_nothing_here_get_a_notice(extra: list[str]) -> None:
    engine, server, notices = build_configs(["m", *extra, "--max-model-len", "64"])
    assert notices == [f"{extra[0].split('=')[0]} is accepted for vLLM compatibility and "
                       "has no effect here"]
    assert engine.model == "m" and engine.max_model_len == 64


@pytest.mark.parametrize("extra,flag,why", [
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow", "split text differently"),
    (["--tokenizer-mode=mistral"], "--tokenizer-mode mistral", "split text differently"),
    (["--load-format", "dummy"], "--load-format dummy", "safetensors checkpoints only"),
    (["--preemption-mode", "swapp"], "--preemption-mode swapp", "recompute or swap"),
    (["--download-dir", "/d"], "--download-dir", "HF_HOME"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile", "terminate TLS"),
    (["--ssl-certfile=c.pem"], "--ssl-certfile", "terminate TLS"),
    (["--root-path", "/v"], "--root-path", "strip the path prefix"),
    (["--rope-scaling", '{"rope_type": "yarn"}'], "--rope-scaling",
     "use --hf-overrides '{\"rope_scaling\": {...}}'"),
    (["--rope-theta=1e6"], "--rope-theta", "use --hf-overrides '{\"rope_theta\": ...}'"),
    (["--hf-overrides", '{"num_hidden_layers": 2}'], "--hf-overrides",
     "'num_hidden_layers' cannot be overridden here"),
    (["--hf-overrides", "rope_scaling=yarn"], "--hf-overrides", "not JSON"),
    (["--max-num-seqs", "4", "--swap-space"], "--swap-space", "expected a value"),
])
def test_vllm_flags_we_do_not_honour_are_refused_in_one_line(extra: list[str], flag: str,
                                                             why: str) -> None:
    """A value that would change outputs (a slow tokenizer, dummy weights) or a feature
    we lack (TLS, a root path) is an error naming it, not a notice."""
    with pytest.raises(ConfigError) as e:
        build_configs(["m", *extra])
    assert str(e.value).startswith(f"{flag}: ") and why in str(e.value)


@pytest.mark.parametrize("extra,prefix,chunked", [
    (["--enable-chunked-prefill", "False"], True, False),
    (["--enable-chunked-prefill=true", "--enable-prefix-caching=FALSE"], False, True),
    (["--no-enable-prefix-caching", "false"], True, True),
    (["--disable-prefix-caching"], False, True),
    (["--disable-prefix-caching=false"], True, True),
])
def test_boolean_flags_take_older_vllms_values(extra: list[str], prefix: bool,
                                               chunked: bool) -> None:
    engine, _, _ = build_configs(["m", *extra, "--max-num-batched-tokens", "65536"])
    assert (engine.enable_prefix_caching, engine.enable_chunked_prefill) == (prefix, chunked)
    engine, _, _ = build_configs(["--enforce-eager", "./model"])   # a model, not a value
    assert engine.enforce_eager and engine.model == "./model"
    with pytest.raises(ConfigError, match="--enforce-eager: expected true or false, got 'yes'"):
        build_configs(["m", "--enforce-eager=yes"])


def test_hf_overrides_is_vllms_flag() -> None:
    """Qwen2.5's 128K context the way vLLM serves it: --hf-overrides with the model
    card's rope_scaling (and a max_position_embeddings, as vLLM users often add)."""
    text = ('{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}')
    engine, _, notices = build_configs(["Qwen/Qwen2.5-7B-Instruct", "--hf-overrides", text])
    assert engine.hf_overrides == text and not notices
    engine, _, _ = build_configs(["m"])
    assert engine.hf_overrides is None


def test_vllm_docs_flag_is_honoured() -> None:
    _, server, notices = build_configs(["m", "--disable-fastapi-docs"])
    assert server.disable_fastapi_docs and not notices
    _, server, _ = build_configs(["m"])
    assert not server.disable_fastapi_docs


def test_help_lists_aliases_ignored_and_refused_vllm_flags() -> None:
    """--help is the reference: every vLLM spelling the server takes or refuses is in it."""
    from pagefleet.server.cli import serve_parser
    from pagefleet.server.config import FLAG_ALIASES, IGNORED_FLAGS, UNSUPPORTED_FLAGS

    text = serve_parser().format_help()
    for flag in (*FLAG_ALIASES, *IGNORED_FLAGS, *UNSUPPORTED_FLAGS):
        assert flag in text, flag
    assert "-tp N                          same as --tensor-parallel-size N" in text
    assert "--disable-prefix-caching       same as --no-enable-prefix-caching" in text
    assert "--tokenizer-mode auto|hf" in text and "--max-model-len" in text
    assert "32K = 32,768" in text
    assert "--hf-overrides JSON" in text and "original_max_position_embeddings" in text


def _config(tmp_path, text: str, *argv: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return build_configs(["--config", str(path), *argv])


def test_config_file_takes_what_the_command_line_takes(tmp_path) -> None:
    engine, server, notices = _config(
        tmp_path, 'max-model-len: "8192"\nport: "8001"\ngpu-memory-utilization: "0.85"\n'
                  'enable-prefix-caching: "false"\ndisable-log-requests: true\n'
                  'trust-remote-code: true\nmax_num_batched_tokens: 16k\n'
                  'served-model-name: [a, b]\noverride-generation-config: {temperature: 0.5}\n'
                  'num_kv_blocks: 12\ntokenizer-mode: auto\nenforce-eager: false\n'
                  'hf-overrides: {rope_scaling: {type: yarn, factor: 4.0}}\n')
    assert (engine.max_model_len, server.port, engine.gpu_memory_utilization) == (8192, 8001, 0.85)
    assert engine.enable_prefix_caching is False and engine.enforce_eager is False
    assert engine.max_num_batched_tokens == 16_000 and engine.num_kv_blocks == 12
    assert server.served_model_name == ["a", "b"]
    assert server.override_generation_config == '{"temperature": 0.5}'
    assert engine.hf_overrides == '{"rope_scaling": {"type": "yarn", "factor": 4.0}}'
    assert len(notices) == 3 and "--trust-remote-code is accepted" in notices[1]
    engine, _, _ = _config(tmp_path, "disable-prefix-caching: true\nmax-model-len: 4k\n",
                           "--max-model-len", "2K")                  # the command line wins
    assert (engine.enable_prefix_caching, engine.max_model_len) == (False, 2048)
    engine, server, _ = _config(tmp_path, "served-model-name: one\nmodel: m\nmax-model-len:\n")
    assert (server.served_model_name, engine.model, engine.max_model_len) == (["one"], "m", None)


@pytest.mark.parametrize("text,words", [
    ('max-model-len: "lots"\n', "argument --max-model-len: invalid value 'lots'"),
    ("port: 80.5\n", "argument --port: invalid int value: '80.5'"),
    ('enable-prefix-caching: "maybe"\n', "--enable-prefix-caching: expected true or false"),
    ("port: [1, 2]\n", "port: expected one value, not a list"),
    ("download-dir: /d\n", "--download-dir: not supported"),
    ("tokenizer-mode: slow\n", "--tokenizer-mode slow: not supported"),
    ("bogus: 1\nmax-model-len: 1\n", "unknown setting(s): bogus"),
])
def test_config_file_errors_name_the_file_and_key(tmp_path, text: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, text)
    assert str(e.value).startswith(f"--config {tmp_path / 'serve.yaml'}: ") and words in str(e.value)


def test_gateway_config_file_is_read_like_its_flags(tmp_path) -> None:
    from pagefleet.server.cli import build_gateway_config

    path = tmp_path / "gw.yaml"
    path.write_text('models-file: m.yaml\nport: "9000"\nendpoint-header: "false"\n'
                    'queue_timeout: "5"\n')
    cfg = build_gateway_config(["--config", str(path)])
    assert (cfg.port, cfg.endpoint_header, cfg.queue_timeout) == (9000, False, 5.0)
    path.write_text("models-file: m.yaml\nretry-after: soon\n")
    with pytest.raises(ConfigError, match="argument --retry-after: invalid int value"):
        build_gateway_config(["--config", str(path)])
