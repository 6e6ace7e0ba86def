"""Backends shared by every gateway test of the session (started once, in parallel).

- short-0..2: `--max-model-len 256` and 28 KV blocks each, so one engine's prefix
  cache holds about two of the affinity test's six system prompts;
- long-0: `--max-model-len 1024` and `--scheduling-policy priority` (the long pool
  of the long/short test, the slow stream that holds a slot in the admission tests,
  the server that takes `priority`).
The failover test kills and restarts short-2.
"""

from __future__ import annotations

import pytest

from tests.gateway.helpers import Backend

SHORT_ARGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "28",
              "--max-num-seqs", "16", "--max-num-batched-tokens", "512"]
LONG_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "16", "--scheduling-policy", "priority"]


@pytest.fixture(scope="session")
def gw_model(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(scope="session")
def backends(gw_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("backend-logs")
    fleet = {f"short-{i}": Backend(f"short-{i}", gw_model, SHORT_ARGS, logs) for i in range(3)}
    # short-1 also answers to the names test_kube's ModelDeployments give their pods (a
    # pod serves its ModelDeployment's servedModelName; the server 404s any other).
    fleet["short-1"] = Backend("short-1", gw_model, SHORT_ARGS, logs, served=("tiny", "keyed", "nokey"))
    fleet["long-0"] = Backend("long-0", gw_model, LONG_ARGS, logs)
    try:
        for b in fleet.values():
            b.start()
        for b in fleet.values():
            b.wait_ready()
        yield fleet
    finally:
        for b in fleet.values():
            b.close()
