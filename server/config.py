"""Engine and server settings: one dataclass each, the single source of truth.

Flag names, defaults and help text live here once. The CLI (`pagefleet serve`), the
YAML config file (`--config`) and the operator (which renders server args) all read
them from these dataclasses, so they cannot drift apart.

This module must stay importable without torch: the operator image imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, get_args, get_type_hints

DEMO_MODEL = "pagefleet-demo"

# Exit code of `pagefleet serve` after a CUDA out-of-memory error (after a one-line log),
# so the operator can tell an OOM apart from other crashes and lower
# --gpu-memory-utilization (its OOM remediation reads the pod's last exit code).
CUDA_OOM_EXIT_CODE = 86
QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "awq_marlin", "gptq_marlin",
                        "compressed-tensors")
MAX_TENSOR_PARALLEL_SIZE = 8   # the GPUs one node holds (the CRD bounds resources.gpus alike)
BLOCK_SIZES = (8, 16, 32, 64, 128)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def opt(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
        metavar: str | None = None, human: bool = False) -> Any:
    """A dataclass field that carries its CLI help (and optional flag/choices).

    `human`: an integer flag that also takes vLLM's k/m/g/t and K/M/G/T suffixes
    (`human_readable_int`), as vLLM's token-count and byte-count flags do. The flag's
    --help says so (cli.add_config_flags), the help text here does not: the CRD
    quotes it for integer fields, which take no suffix."""
    meta: dict[str, Any] = {"help": help}
    if flag:
        meta["flag"] = flag
    if choices:
        meta["choices"] = choices
    if metavar:
        meta["metavar"] = metavar
    if human:
        meta["human"] = True
    return field(default=default, metadata=meta)


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's rule for its large-integer flags (`--max-model-len 32k`), so a launch line
    that vLLM takes is taken here with the same number: a lowercase suffix multiplies
    by 1000s and may follow a decimal (25.6k = 25,600; 1m = 1,000,000), an uppercase one
    by 1024s and must follow a whole number (32K = 32,768; 1.5K is refused); anything
    else is a plain integer."""
    value = value.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"invalid value {value!r}: decimals are not allowed with the binary suffix "
                f"{suffix} (x1024); did you mean {number}{suffix.lower()} (x1000)?")
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected a whole number, optionally with a suffix: "
            "k, m, g, t (x1000) or K, M, G, T (x1024), e.g. 32k or 32K") from None


# Longer than the 60 s idle timeout of the usual proxies in front of a server (nginx
# ingress's upstream keep-alive, AWS ALB), so the proxy, not the server, ends an idle
# connection; uvicorn's own 5 s default races every pooled proxy connection.
KEEP_ALIVE_TIMEOUT_S = 75.0
# How much earlier a long prompt may have been queued and still let a short one go first
# (engine/request_queue.py): a few long-prefill steps, and the bound on a long prompt's
# extra wait under a steady stream of short ones.
SHORT_PROMPT_OVERTAKE_S = 2.0


# The CUDA graph modes offered (vLLM's names). vLLM's FULL and PIECEWISE alone are not:
# whole-forward graphs for mixed steps cannot hold their attention, and pieces for pure
# decodes would only be slower than the decode graphs.
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")


class ConfigError(ValueError):
    """A setting is out of range or inconsistent; the message names the flag."""


def need(cond: bool, flag: str, msg: str) -> None:
    """One bound of a `validate()`: a ConfigError naming the flag when `cond` is false."""
    if not cond:
        raise ConfigError(f"--{flag}: {msg}")


@dataclass
class EngineConfig:
    """What the engine needs: model, memory and scheduling."""

    model: str | None = opt(None, "Local HF model directory or Hugging Face repo id. "
                            "Omit to serve the built-in demo model.")
    tokenizer: str | None = opt(None, "Tokenizer directory or repo id (default: the model's).")
    revision: str | None = opt(None, "Model revision (branch, tag or commit) on the Hub.")
    dtype: str = opt("auto", "Weight and activation dtype. 'auto': float32 on CPU; on a "
                     "GPU the checkpoint's dtype, with float32 checkpoints served in "
                     "bfloat16.",
                     choices=("auto", "float32", "float16", "bfloat16", "half"))
    hf_overrides: str | dict | None = opt(
        None, "JSON object of config.json values to override, as vLLM's flag takes it: "
        "rope_scaling (or rope_parameters), rope_theta, max_position_embeddings, e.g. "
        "Qwen2.5's 128K context: '{\"rope_scaling\": {\"rope_type\": \"yarn\", "
        "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}}'. Each key "
        "replaces the config's whole value; other keys are refused (edit config.json).",
        metavar="JSON")
    max_model_len: int | None = opt(None, "Model context length (prompt + output). "
                                    "Default: the model config's max_position_embeddings; "
                                    "with linear rope scaling times its factor, with yarn "
                                    "its original_max_position_embeddings times its factor "
                                    "(vLLM's rule).",
                                    human=True)
    max_num_seqs: int | None = opt(None, "Maximum number of sequences per engine step. "
                                   "Default by device, as vLLM picks: 1024 on GPUs with at "
                                   "least 70 GiB, else 256.")
    max_num_batched_tokens: int | None = opt(
        None, "Maximum number of tokens per engine step. Without chunked prefill it must be "
        ">= max-model-len. Default by use and device, as vLLM picks: the API server takes "
        "8192 on GPUs with at least 70 GiB and 2048 otherwise; the offline LLM 16384 / 8192.",
        human=True)
    long_prefill_token_threshold: int = opt(0, "Most prompt tokens one request may prefill "
                                            "in a step (0: up to the token budget). Smaller "
                                            "chunks let short requests in sooner.")
    short_prompt_tokens: int = opt(
        1024, "Prompts with at most this many tokens to compute go ahead of longer ones "
        f"that were queued less than {SHORT_PROMPT_OVERTAKE_S:g} s before them, so a short "
        "question does not wait out a long document's prefill; a long prompt is never "
        f"passed over for longer than that (0: strict policy order).")
    block_size: int | None = opt(
        None, "Tokens per KV cache block (prefixes are reused in whole blocks). Default by "
        "device: 128 on GPUs with TMA (compute capability 9.0 and later), where each "
        "128-token key tile of the prefill attention is one page and comes by one bulk "
        "copy (long prompts prefill faster); 16, vLLM's, elsewhere.",
        choices=BLOCK_SIZES)
    enable_prefix_caching: bool = opt(True, "Reuse KV cache blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = opt(True, "Split long prompts into chunks that fit the "
                                       "token budget, interleaved with decodes.")
    gpu_memory_utilization: float = opt(0.9, "Fraction of GPU memory the engine may use "
                                        "(weights + activations + KV cache).")
    kv_cache_memory: int | None = opt(None, "KV cache size in bytes per rank (CPU, or to "
                                      "override GPU sizing). Default on CPU: 512 MiB.",
                                      human=True)
    num_kv_blocks: int | None = opt(None, "Exact number of KV cache blocks (overrides sizing; "
                                    "for tests and experiments).", flag="--num-gpu-blocks-override")
    kv_cache_dtype: str = opt("auto", "KV cache dtype ('auto' = model dtype).",
                              choices=("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32"))
    scheduling_policy: str = opt("fcfs", "fcfs: first come first served. priority: lower "
                                 "'priority' value first, then arrival.",
                                 choices=("fcfs", "priority"))
    enforce_eager: bool = opt(False, "Disable CUDA graphs (the decode graphs and the mixed "
                              "steps' piecewise graphs).")
    cudagraph_mode: str = opt(
        "FULL_AND_PIECEWISE", "Which steps replay CUDA graphs (vLLM's names): "
        "FULL_AND_PIECEWISE: pure decodes as whole-forward graphs, mixed steps of up to "
        "1,024 tokens as pieces around their attention kernels; FULL_DECODE_ONLY: pure "
        "decodes only, mixed steps eager; NONE: no graphs (as --enforce-eager).",
        choices=CUDAGRAPH_MODES)
    async_scheduling: bool = opt(True, "Queue the next decode step on the device before "
                                 "reading back this one's tokens, so host work overlaps "
                                 "the forward (outputs are the same).")
    device: str = opt("auto", "Device to run on.", choices=("auto", "cpu", "cuda"))
    seed: int = opt(0, "Seed for sampling of requests that set no seed.")
    tensor_parallel_size: int = opt(
        1, "Number of GPUs one replica's model is sharded over (Megatron-style tensor "
        "parallelism, one worker process per GPU, NCCL between them). Must divide the "
        "model's attention heads. With --device cpu the ranks are CPU processes over gloo. "
        "Short form: -tp N.")
    pipeline_parallel_size: int = opt(
        1, "Pipeline stages; only 1 is supported (use --tensor-parallel-size within a node, "
        "and replicas across nodes). Short form: -pp N.")
    distributed_executor_backend: str | None = opt(
        None, "How the tensor-parallel workers run: 'mp' (one process per GPU, the only "
        "backend for more than one GPU) or 'uni' (one process; tensor-parallel size 1). "
        "Default: uni for one GPU, mp for more.")
    max_logprobs: int = opt(20, "Most logprobs (top-N per token) a request may ask for.")
    startup_timeout: float = opt(
        1800.0, "Seconds the engine may take to become ready (load the weights on every "
        "tensor-parallel rank, profile memory, capture graphs, warm up) before startup "
        "fails. Raise it for very large models on slow storage; a ModelDeployment's "
        "startupTimeoutSeconds sets it.")
    quantization: str | None = opt(None, "Weight quantization: fp8 (fp8 checkpoints, or "
                                   "a bf16/fp16 one quantized at load), awq, gptq "
                                   "(awq_marlin, gptq_marlin: the same), compressed-tensors "
                                   "(llm-compressor checkpoints: fp8, as fp8 takes them, and "
                                   "W4A16 pack-quantized 4-bit). "
                                   "Default: the checkpoint's quantization config; a flag "
                                   "that does not match the checkpoint is a startup error.",
                                   choices=QUANTIZATION_METHODS)

    def validate(self) -> None:
        need(self.max_num_seqs is None or self.max_num_seqs >= 1, "max-num-seqs", "must be >= 1")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max-num-batched-tokens", "must be >= 1")
        need(self.long_prefill_token_threshold >= 0, "long-prefill-token-threshold",
             "must be >= 0")
        need(self.short_prompt_tokens >= 0, "short-prompt-tokens", "must be >= 0")
        need(self.startup_timeout > 0, "startup-timeout", "must be > 0")
        need(self.block_size is None or self.block_size in BLOCK_SIZES, "block-size",
             f"must be one of {','.join(map(str, BLOCK_SIZES))}")
        need(0 < self.gpu_memory_utilization <= 1, "gpu-memory-utilization", "must be in (0, 1]")
        need(self.max_model_len is None or self.max_model_len >= 1, "max-model-len", "must be >= 1")
        from pagefleet.server.models.config import parse_hf_overrides
        parse_hf_overrides(self.hf_overrides)     # a ConfigError naming the flag
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv-cache-memory", "must be > 0")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num-gpu-blocks-override",
             "must be >= 1")
        need(self.scheduling_policy in ("fcfs", "priority"), "scheduling-policy",
             "must be fcfs or priority")
        need(1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE,
             "tensor-parallel-size",
             f"must be between 1 and {MAX_TENSOR_PARALLEL_SIZE} (the GPUs of one node)")
        need(self.pipeline_parallel_size == 1, "pipeline-parallel-size",
             f"pipeline parallelism ({self.pipeline_parallel_size} stages) is not supported; "
             "use --tensor-parallel-size to shard the model over the GPUs of one node, and "
             "replicas to scale across nodes")
        backend = self.distributed_executor_backend
        need(backend in (None, "mp", "uni"), "distributed-executor-backend",
             f"{backend!r} is not supported; use 'mp' (one worker process per GPU)")
        need(not (backend == "uni" and self.tensor_parallel_size > 1),
             "distributed-executor-backend",
             f"'uni' runs one process, but --tensor-parallel-size is "
             f"{self.tensor_parallel_size}; use 'mp'")
        need(self.max_logprobs >= 0, "max-logprobs", "must be >= 0")
        need(self.cudagraph_mode in CUDAGRAPH_MODES, "cudagraph-mode",
             f"must be one of {', '.join(CUDAGRAPH_MODES)}")
        need(self.quantization is None or self.quantization in QUANTIZATION_METHODS,
             "quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)}")
        if self.dtype == "half":
            self.dtype = "float16"


LARGE_GPU_BYTES = 70 << 30
TMA_BLOCK_SIZE = 128     # the prefill kernel's key tile (ops/triton_attention.py)


def default_limits(usage: str, gpu_memory_bytes: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a use ("server" or "offline") on a
    device: vLLM's choice by GPU memory (>= 70 GiB: large), CPUs as small GPUs."""
    large = gpu_memory_bytes is not None and gpu_memory_bytes >= LARGE_GPU_BYTES
    seqs = 1024 if large else 256
    if usage == "offline":
        return seqs, 16384 if large else 8192
    return seqs, 8192 if large else 2048


def default_block_size(capability: tuple[int, int] | None) -> int:
    """KV block size for a device: a whole prefill key tile per page where the GPU has
    TMA (H200, 2026-12-03: 8K-over-16K prefill attention 2.91-3.08 against 3.08-3.15 ms,
    the 16-document online run 253 against 250 out tok/s, the other workloads equal);
    vLLM's 16 on older GPUs and the CPU."""
    return TMA_BLOCK_SIZE if capability is not None and capability >= (9, 0) else 16


def resolve_limits(config: "EngineConfig", usage: str, gpu_memory_bytes: int | None,
                   capability: tuple[int, int] | None = None) -> str:
    """Fill unset limits (and the block size, from the GPU's compute `capability`) from
    `default_limits` / `default_block_size`; returns a line saying what was picked."""
    seqs, tokens = default_limits(usage, gpu_memory_bytes)
    picked = []
    if config.block_size is None:
        config.block_size = default_block_size(capability)
        picked.append(f"--block-size {config.block_size}")
    if config.max_num_seqs is None:
        config.max_num_seqs = seqs
        picked.append(f"--max-num-seqs {seqs}")
    if config.max_num_batched_tokens is None:
        config.max_num_batched_tokens = tokens
        picked.append(f"--max-num-batched-tokens {tokens}")
    where = (f"a GPU with {gpu_memory_bytes / (1 << 30):.0f} GiB" if gpu_memory_bytes
             else "the CPU")
    return (f"defaults for the {usage} on {where}: {', '.join(picked)}" if picked else "")


def probe_gpu() -> tuple[int | None, tuple[int, int] | None]:
    """(total memory, compute capability) of GPU 0 without creating a CUDA context
    (nvidia-smi), or Nones."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if not exe:
        return None, None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total,compute_cap",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout.splitlines()
        if not out:
            return None, None
        mem, cap = (x.strip() for x in out[0].split(","))
        major, minor = cap.split(".")
        return int(float(mem)) << 20, (int(major), int(minor))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None, None


@dataclass
class ServerConfig:
    """What the HTTP server adds around the engine."""

    host: str = opt("0.0.0.0", "Address to listen on.")
    port: int = opt(8000, "Port to listen on (bound before the model loads; 0: a free port, "
                    "named in the log's \"listening on\" line).")
    served_model_name: list[str] | None = opt(
        None, "Model name(s) in the API; the first is the one responses report, the others "
        "are accepted aliases (default: the model path).", metavar="NAME")
    response_role: str = opt("assistant", "Role of the generated chat message.")
    enable_auto_tool_choice: bool = opt(False, "Let the model call tools on its own "
                                        "(tool_choice 'auto'); needs --tool-call-parser.")
    tool_call_parser: str | None = opt(None, "How tool calls are written in the model's "
                                       "output.", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = opt(None, "Split <think>...</think> reasoning into "
                                       "reasoning_content.", choices=REASONING_PARSERS)
    enable_prompt_tokens_details: bool = opt(False, "Report usage.prompt_tokens_details "
                                             "(cached_tokens).")
    generation_config: str = opt("auto", "Sampling defaults: 'auto' (the model's "
                                 "generation_config.json), 'vllm' (none: vLLM's own "
                                 "defaults), or a folder holding a generation_config.json.")
    override_generation_config: str | None = opt(None, "JSON object of sampling defaults "
                                                 "that override the generation config's.")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' on /v1/* "
                              "(without the flag: PAGEFLEET_API_KEY, then vLLM's "
                              "VLLM_API_KEY).")
    chat_template: str | None = opt(None, "Jinja chat template (file path or inline) that "
                                    "overrides the tokenizer's.")
    trust_request_chat_template: bool = opt(False, "Accept a request's own chat_template "
                                            "(vLLM's flag; without it such a request gets "
                                            "400: a template runs code on the server).")
    max_num_queued_requests: int = opt(1024, "Waiting-queue cap: beyond it requests get 429.")
    max_request_body_bytes: int = opt(32 << 20, "Largest request body accepted; larger "
                                      "ones get 413 before they are parsed.")
    request_body_timeout: float = opt(
        60.0, "Seconds a client may take to send its whole request body, counted from "
        "its headers; past it: 408 and the connection closes (a client trickling a body "
        "cannot hold a connection for ever). Header reads need a reverse proxy's timeout.")
    queue_timeout: float | None = opt(None, "Seconds a request may wait before it is "
                                      "scheduled; past it the request gets 503.")
    shutdown_timeout: float = opt(30.0, "On SIGTERM, seconds to let in-flight requests finish.")
    disable_fastapi_docs: bool = opt(False, "Do not serve /docs, /redoc and /openapi.json "
                                     "(vLLM's flag; they are open without an API key).")
    enable_log_requests: bool = opt(False, "Log prompts and outputs (truncated to --max-log-len).")
    max_log_len: int = opt(200, "Characters of prompt/output logged with --enable-log-requests.")
    log_stats_interval: float = opt(10.0, "Seconds between throughput/queue/KV log lines.")
    uvicorn_log_level: str = opt("warning", "Log level of uvicorn's own loggers.",
                                 choices=("critical", "error", "warning", "info", "debug", "trace"))
    timeout_keep_alive: float = opt(
        KEEP_ALIVE_TIMEOUT_S, "Seconds an idle keep-alive connection stays open. Keep it "
        "above the idle timeout of every proxy in front (nginx ingress and AWS ALB: 60 s), "
        "or a proxy can reuse a connection just as the server closes it: a 502.")

    def validate(self) -> None:
        need(0 <= self.port <= 65535, "port", "must be in 0..65535")
        need(self.max_num_queued_requests >= 1, "max-num-queued-requests", "must be >= 1")
        need(self.max_request_body_bytes >= 1, "max-request-body-bytes", "must be >= 1")
        need(self.request_body_timeout > 0, "request-body-timeout", "must be > 0")
        need(self.queue_timeout is None or self.queue_timeout > 0, "queue-timeout", "must be > 0")
        need(self.shutdown_timeout >= 0, "shutdown-timeout", "must be >= 0")
        need(self.max_log_len >= 0, "max-log-len", "must be >= 0")
        need(self.log_stats_interval > 0, "log-stats-interval", "must be > 0")
        need(self.timeout_keep_alive > 0, "timeout-keep-alive", "must be > 0")


# vLLM flags handled before the parser (cli.normalize_flags), on the command line and in
# --config files alike, so launch lines and config files written for vLLM keep working
# and `--help` can list them (cli.serve_parser's epilog).

# Older spellings vLLM users still type, mapped to ours.
FLAG_ALIASES: dict[str, str] = {
    "--disable-prefix-caching": "--no-enable-prefix-caching",
    "--kv-cache-memory-bytes": "--kv-cache-memory",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
}

# Flags vLLM takes (or older releases took) that change nothing here but speed, memory
# or logging: accepted with a one-line notice. The value is how many arguments follow.
# Ignoring one is only right where pagefleet already gives what the flag asks for, or
# the flag cannot change a response: a value that would change outputs is refused
# (IGNORED_ONLY_WITH), never dropped.
IGNORED_FLAGS: dict[str, int] = {
    "--disable-log-requests": 0,
    "--trust-remote-code": 0,        # only model code from the Hub needs it; none runs here
    "--disable-log-stats": 0,
    "--swap-space": 1,
    "--worker-use-ray": 0,
    "--engine-use-ray": 0,
    "--disable-custom-all-reduce": 0,
    "--uvicorn-log-level-access": 1,
    "--max-parallel-loading-workers": 1,
    "--use-v2-block-manager": 0,
    "--num-scheduler-steps": 1,      # vLLM 0.6 multi-step decoding: speed only
    "--disable-frontend-multiprocessing": 0,
    "--max-seq-len-to-capture": 1,   # CUDA graph capture bound: speed only
    # pagefleet never runs sliding-window attention: --max-model-len is capped at the
    # window, which is what this flag asks vLLM for.
    "--disable-sliding-window": 0,
    "--tokenizer-mode": 1,
    "--preemption-mode": 1,
    "--load-format": 1,
}

# Ignored flags whose other values would change what the server answers: those values
# are refused with the reason, since ignoring them would silently change results.
IGNORED_ONLY_WITH: dict[str, tuple[tuple[str, ...], str]] = {
    "--tokenizer-mode": (
        ("auto", "hf"),
        "pagefleet always tokenizes with the model's Hugging Face fast tokenizer "
        "(tokenizer.json: what auto and hf pick); a slow, mistral or custom tokenizer "
        "can split text differently, so the outputs would change"),
    "--preemption-mode": (
        ("recompute", "swap"),
        "vLLM takes recompute or swap; pagefleet always preempts by recomputing, as "
        "vLLM V1 does: a preempted request keeps its tokens and resumes later"),
    "--load-format": (
        ("auto", "safetensors"),
        "pagefleet loads safetensors checkpoints only; other formats (and 'dummy', "
        "random weights) would load something else or nothing"),
}

# vLLM flags that ask for something pagefleet does not do: a one-line error naming the
# flag and what to do instead (not argparse's usage block), since ignoring them would
# leave the user believing it is done.
UNSUPPORTED_FLAGS: dict[str, str] = {
    "--download-dir": "not supported: Hub models go to the Hugging Face cache; set "
                      "HF_HOME or HF_HUB_CACHE to choose where, or pass a local directory",
    "--ssl-keyfile": "not supported: pagefleet serves plain HTTP; terminate TLS at the "
                     "ingress, load balancer or proxy in front of it",
    "--ssl-certfile": "not supported: pagefleet serves plain HTTP; terminate TLS at the "
                      "ingress, load balancer or proxy in front of it",
    "--ssl-ca-certs": "not supported: pagefleet serves plain HTTP; terminate TLS at the "
                      "ingress, load balancer or proxy in front of it",
    "--root-path": "not supported: the API is served at /; have the proxy in front strip "
                   "the path prefix",
    "--enable-lora": "not supported: LoRA adapters are not served; merge the adapter into "
                     "the weights and serve the merged model",
    "--lora-modules": "not supported: LoRA adapters are not served; merge the adapter into "
                      "the weights and serve the merged model",
    "--speculative-config": "not supported: speculative decoding is not implemented",
    "--speculative-model": "not supported: speculative decoding is not implemented",
    # vLLM dropped these two for --hf-overrides, which pagefleet takes.
    "--rope-scaling": "not supported (vLLM has dropped it too): use --hf-overrides "
                      "'{\"rope_scaling\": {...}}', or set rope_scaling in the model's "
                      "config.json",
    "--rope-theta": "not supported (vLLM has dropped it too): use --hf-overrides "
                    "'{\"rope_theta\": ...}', or set rope_theta in the model's config.json",
    "--allowed-origins": "not supported: no CORS headers are sent; add them at the proxy "
                         "in front",
}


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def config_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, resolved type) pairs of a config dataclass."""
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def base_type(tp: Any) -> type:
    """int | None -> int; bool -> bool."""
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def engine_flag(name: str) -> str:
    """The server flag for an EngineConfig/ServerConfig field, e.g. 'max_model_len'."""
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.name == name:
                return flag_name(f)
    raise KeyError(name)
