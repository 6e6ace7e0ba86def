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
