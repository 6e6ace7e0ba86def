"""e2e fixtures: one cluster per module (emulated unless KUBECONFIG is set)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from e2e.cluster import Cluster, FakeCluster, RealCluster
from tests.deploy import tools


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    kubectl = tools.require("kubectl")
    workdir = tmp_path_factory.mktemp("e2e")
    c: Cluster = RealCluster(kubectl, workdir) if os.environ.get("KUBECONFIG") else FakeCluster(kubectl, workdir)
    try:
        yield c
    finally:
        c.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """On an e2e failure, attach the pods' logs (operator and servers) to the report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "cluster" in getattr(item, "funcargs", {}):
        try:
            report.sections.append(("cluster logs", item.funcargs["cluster"].logs()[-20000:]))
        except Exception as e:  # noqa: BLE001
            report.sections.append(("cluster logs", f"unavailable: {e!r}"))
