"""Shared fixtures: tiny models are built once per session into a temp folder."""

from __future__ import annotations

import os

import pytest

# Tiny models on a 2-core machine run fastest on one thread per process: tests start
# several processes at once (servers, engine cores), and two OpenMP threads each
# oversubscribe the cores. Engine cores read PAGEFLEET_CPU_THREADS.
os.environ.setdefault("PAGEFLEET_CPU_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    try:
        import torch
    except ImportError:   # the operator-only install
        return
    torch.set_num_threads(int(os.environ["PAGEFLEET_CPU_THREADS"]))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> model dir; built lazily, once per session."""
    from pagefleet.server.testing import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    built: dict[str, object] = {}

    def get(name: str, **kwargs):
        if name not in built:
            arch = kwargs.pop("arch", name.split("-")[0])
            built[name] = build_tiny_model(root / name, arch, **kwargs)
        return built[name]

    return get
