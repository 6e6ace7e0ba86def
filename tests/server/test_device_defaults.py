"""Defaults picked by use and device (issue 9): the limits vLLM picks by GPU memory, and
the KV block size by GPU generation (a whole prefill key tile per page where the GPU has
TMA). An explicit flag always wins; `pagefleet serve --help` says what this machine gets,
read from nvidia-smi without touching CUDA."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pagefleet.server.cli import machine_defaults
from pagefleet.server.config import (
    LARGE_GPU_BYTES,
    TMA_BLOCK_SIZE,
    ConfigError,
    EngineConfig,
    default_block_size,
    default_limits,
    probe_gpu,
    resolve_limits,
)


@pytest.mark.parametrize("capability,block", [(None, 16), ((8, 0), 16), ((8, 9), 16),
                                              ((9, 0), TMA_BLOCK_SIZE), ((10, 0), TMA_BLOCK_SIZE)])
def test_block_size_by_gpu_generation(capability, block) -> None:
    assert default_block_size(capability) == block
    cfg = EngineConfig()
    note = resolve_limits(cfg, "server", LARGE_GPU_BYTES if capability else None, capability)
    assert cfg.block_size == block and f"--block-size {block}" in note


def test_an_explicit_block_size_is_kept() -> None:
    cfg = EngineConfig(block_size=32)
    note = resolve_limits(cfg, "server", LARGE_GPU_BYTES, (9, 0))
    assert cfg.block_size == 32 and "--block-size" not in note


def test_limits_by_use_and_memory() -> None:
    assert default_limits("server", LARGE_GPU_BYTES) == (1024, 8192)
    assert default_limits("offline", LARGE_GPU_BYTES) == (1024, 16384)
    assert default_limits("server", LARGE_GPU_BYTES - 1) == (256, 2048)
    assert default_limits("offline", None) == (256, 8192)


def test_a_block_size_outside_the_choices_is_an_error() -> None:
    with pytest.raises(ConfigError, match="--block-size: must be one of 8,16,32,64,128"):
        EngineConfig(block_size=12).validate()
    EngineConfig().validate()   # unset: picked by device later


def _fake_nvidia_smi(tmp_path: Path, line: str) -> str:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '{line}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"


def test_help_says_what_an_h200_gets(tmp_path, monkeypatch) -> None:
    """The --help defaults come from nvidia-smi's memory and compute capability (the API
    process must not create a CUDA context)."""
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, "143771, 9.0"))
    assert probe_gpu() == (143771 << 20, (9, 0))
    here = machine_defaults()
    assert here["block_size"].startswith(f"{TMA_BLOCK_SIZE} on this machine")
    assert here["max_num_seqs"].startswith("1024 on this machine")


def test_help_on_an_older_gpu_and_without_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, "81559, 8.0"))
    assert machine_defaults()["block_size"].startswith("16 on this machine")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert probe_gpu() == (None, None)
    assert machine_defaults()["block_size"] == "16 on this machine (no GPU)"
