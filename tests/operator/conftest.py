"""Fixtures for the operator tests (the parts are in harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import kmock
import pytest
import pytest_asyncio
import yaml

from tests.operator.harness import Cluster, Emulator, operator_process, register_resources


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    emulator = Emulator()
    async with emulator, kmock.Server(emulator):
        register_resources(emulator)
        kubeconfig = tmp_path_factory.mktemp("kube") / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": str(emulator.url)}}],
            "users": [{"name": "kmock", "user": {}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        c = Cluster(emulator, kubeconfig)
        try:
            yield c
        finally:
            await c.kube.close()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """One operator (all namespaces, standalone) per test module; tests use their
    own namespaces."""
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    async with operator_process(cluster, log_path, "--standalone") as liveness:
        yield liveness
