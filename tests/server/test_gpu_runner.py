"""Runner pieces of the CUDA path that can be checked without a GPU: KV sizing
messages, the startup free-memory check, padded decode sizes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagefleet.server import LLM  # noqa: E402
from pagefleet.server.config import ConfigError, EngineConfig  # noqa: E402
from pagefleet.server.engine import runner as runner_mod  # noqa: E402


def test_decode_batch_sizes():
    assert runner_mod.decode_batch_sizes(1) == [1]
    assert runner_mod.decode_batch_sizes(3) == [1, 2, 3]
    sizes = runner_mod.decode_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b % 8 == 0 for b in sizes[3:])
    assert runner_mod.decode_batch_sizes(100)[-2:] == [96, 100]
    big = runner_mod.decode_batch_sizes(1024)
    assert big[-1] == 1024 and 504 in big and 512 in big and 520 not in big
    assert all(b % 16 == 0 for b in big if b >= 512)
    assert runner_mod.MAX_GRAPH_BATCH >= 1024   # the large-GPU default max_num_seqs


def test_default_ops_is_torch_on_cpu():
    from pagefleet.server.models.decoder import Ops
    assert runner_mod.default_ops(torch.device("cpu")) is Ops


def test_cache_too_small_for_one_request_names_the_flags(tiny_models):
    model_dir = tiny_models("qwen3")
    with pytest.raises(ConfigError) as e:
        LLM(model_dir, max_model_len=2048, kv_cache_memory=64 * 1024)
    msg = str(e.value)
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--kv-cache-dtype"):
        assert flag in msg


def test_low_free_gpu_memory_at_startup_is_an_error(monkeypatch):
    """The check runs before any weights load, and says what to change."""
    r = runner_mod.ModelRunner.__new__(runner_mod.ModelRunner)
    r.config = EngineConfig(gpu_memory_utilization=0.9)
    r.device = torch.device("cuda", 0)
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (100 * gib, 140 * gib))
    with pytest.raises(ConfigError, match="gpu-memory-utilization") as e:
        r._check_free_memory()
    assert "100.00 GiB" in str(e.value) and "126.00 GiB" in str(e.value)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (130 * gib, 140 * gib))
    r._check_free_memory()
    assert r._mem_at_start[0] == 130 * gib


def test_decode_graph_context_buckets():
    """Small decode batches get a graph per context bucket (so a short context does not
    launch a long one's split-K programs); the widths are in blocks."""
    assert runner_mod.context_buckets(32768, 16) == [128, 512, 2048]
    assert runner_mod.context_buckets(2048, 16) == [128]
    assert runner_mod.context_buckets(5000, 32) == [64, 157]


def test_gemm_sweep_grid_meets_every_spacing():
    """Every count to 256, then at most 8 apart to 2,048 and 16 beyond, ending at the
    step budget: cuBLAS switches kernels at tile and wave boundaries, and the first
    launch of each kernel waits for the device (engine/gemm_warmup.py)."""
    from pagefleet.server.engine.gemm_warmup import token_grid
    assert token_grid(5) == [1, 2, 3, 4, 5]
    g = token_grid(8192)
    assert g[:256] == list(range(1, 257)) and g[-1] == 8192
    gaps = [(b, b - a) for a, b in zip(g, g[1:])]
    assert all(d > 0 for _, d in gaps)
    assert max(d for b, d in gaps if b <= 2048) == 8
    assert max(d for b, d in gaps) == 16
    odd = token_grid(3000)
    assert odd[-1] == 3000 and odd[-2] < 3000 and len(set(odd)) == len(odd)


def test_gemm_sweep_runs_each_projection_and_lm_head_at_every_count(tiny_models, monkeypatch):
    """The sweep goes through the model's own linear layers (their quantization method,
    the qkv bias), each at every grid count, and lm_head at every row count."""
    from pagefleet.server.engine import gemm_warmup
    llm = LLM(tiny_models("qwen2"), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=300)
    model = llm.engine.core.runner.model
    layer = model.layers[0]
    seen: dict[str, list[int]] = {}
    for name, mod in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                      ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
        mod.register_forward_hook(lambda m, args, out, name=name: seen.setdefault(
            name, []).append((args[0].shape[0], args[0].shape[1], out.shape[1])))
    head = model.head_weight
    real_linear = torch.nn.functional.linear
    head_rows: list[int] = []

    def linear(x, w, b=None):
        if w is head:
            head_rows.append(x.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    down = layer.mlp.down_proj
    silu_rows: list[tuple[int, int]] = []
    real_silu = down.forward_silu_mul

    def forward_silu_mul(x):
        silu_rows.append(tuple(x.shape))
        return real_silu(x)

    monkeypatch.setattr(down, "forward_silu_mul", forward_silu_mul)
    launches, _ = gemm_warmup.warm_gemm_kernels(model, 300, 40)
    grid = gemm_warmup.token_grid(300)
    for name, mod in (("qkv", layer.self_attn.qkv_proj), ("down", layer.mlp.down_proj)):
        assert [m for m, _, _ in seen[name]] == grid
        assert {k for _, k, _ in seen[name]} == {mod.input_size_per_partition}
    assert [m for m, _, _ in seen["o"]] == grid and [m for m, _, _ in seen["gate_up"]] == grid
    assert head_rows == list(range(1, 41))
    # and the down projection on [gate | up] rows as the MLP calls it, 1..32 rows
    assert silu_rows == [(m, 2 * down.input_size_per_partition)
                         for m in range(1, gemm_warmup.SILU_ROWS + 1)]
    assert launches == 4 * len(grid) + gemm_warmup.SILU_ROWS + 40
