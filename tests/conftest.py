"""Shared fixtures: tiny models are built once per session into a temp folder."""

from __future__ import annotations

import pytest


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
