"""Shared fixtures: tiny models are built once per session into a temp folder."""

from __future__ import annotations

import os
import sys

import pytest

# Tiny models on a 2-core machine run fastest on one thread per process: tests start
# several processes at once (servers, engine cores), and two OpenMP threads each
# oversubscribe the cores. Engine cores read PAGEFLEET_CPU_THREADS.
os.environ.setdefault("PAGEFLEET_CPU_THREADS", "1")


def pytest_configure(config) -> None:
    """The project's own modules byte-compiled once, before any test starts a process.
    Where PYTHONDONTWRITEBYTECODE is set (these machines set it), no import ever writes
    a .pyc, so every process the tests start (servers, engine cores, the operator, CLI
    runs: hundreds in a run) compiled server/ and operator/ from source again: 0.25 s of
    CPU of its ~4 s import (site-packages keep the .pyc files pip wrote). An explicit
    compile writes them whatever that variable says; the controller does it, not each
    xdist worker. Sources newer than their .pyc are recompiled as usual."""
    if hasattr(config, "workerinput"):
        return
    import compileall
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for sub in ("server", "operator", "e2e"):
        if (root / sub).is_dir():
            compileall.compile_dir(root / sub, quiet=2, workers=1)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    try:
        import torch
    except ImportError:   # the operator-only install
        return
    torch.set_num_threads(int(os.environ["PAGEFLEET_CPU_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_once():
    """Interpreted Triton kernels (TRITON_INTERPRET=1) without redundant work per
    helper call and per op (tests/triton_interpreter.py). After collection, where the kernel test
    modules have set TRITON_INTERPRET and imported triton: importing triton before that
    would make its standard library compiled, not interpreted, functions."""
    if "triton" in sys.modules and not os.environ.get("PAGEFLEET_TRITON_INTERPRETER_AS_IS"):
        from tests import triton_interpreter
        triton_interpreter.install()


def _one_httpx_ssl_context() -> None:
    """One default SSL context for the httpx clients of a test process. httpx builds a
    context (certifi's or SSL_CERT_FILE's CA bundle: ~28 ms of CPU) for every client, and
    `httpx.get` is a client per call: the tests' polling loops (/metrics, /health, the
    e2e cluster's waits, every 50 ms) spent about half a core on contexts for plain-HTTP
    loopback servers. Only the default context (verify=True, no client certificate) is
    shared, one per (trust_env, SSL_CERT_FILE, SSL_CERT_DIR), the inputs httpx builds it
    from; it is what each call would build (httpx never changes it; httpcore sets ALPN
    on it, per connection, only for TLS connections, which no test makes). Done when
    this conftest is imported, so that in a run that collects tests/ (the suite's) it
    holds for every test of the process, the e2e files' too: they are outside tests/,
    where a session fixture of this conftest would not run for them.
    PAGEFLEET_HTTPX_SSL_AS_IS=1 leaves httpx alone."""
    if os.environ.get("PAGEFLEET_HTTPX_SSL_AS_IS"):
        return
    try:
        from httpx._transports import default
    except ImportError:
        return
    create = getattr(default, "create_ssl_context", None)
    if create is None or getattr(create, "_pagefleet_shared", False):
        return
    shared: dict = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    create_ssl_context._pagefleet_shared = True
    default.create_ssl_context = create_ssl_context


_one_httpx_ssl_context()


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


@pytest.fixture(scope="session")
def tools_model(tiny_models):
    """The tiny qwen3 with the hermes tools template and think tokens, which the chat
    and Responses API tests share (one build a session)."""
    from pagefleet.server.chat_templates import TOOLS_CHAT_TEMPLATE
    return tiny_models("qwen3-tools", arch="qwen3", chat_template=TOOLS_CHAT_TEMPLATE,
                       added_tokens=("<think>", "</think>"))


# -- spreading the suite over the xdist workers ----------------------------------------------
#
# `-n 2 --dist loadfile` (pyproject addopts) runs each test file on one worker: module
# fixtures (servers, e2e clusters) start once and e2e tests keep their order. A worker
# that runs dry takes the next file. Two things decide the wall time on the 2-core CI
# machine: the longest files must start first (a long file taken last runs alone), and
# the end must be made of small pieces. So, for loadfile runs:
# - the files below start in order of FILE_SECONDS, longest first (the others after);
# - the Triton kernel tests (SPREAD: no module state, a third of the suite's CPU time, all
#   interpreted) come last, each test a work unit of its own, so both workers finish
#   within a test of each other.

SPREAD = ("tests/server/test_kernels_", "tests/server/test_quant_kernels_")

# Seconds each file took in a full run (2 workers, 2-core machine, 2026-12-03); files
# under ~5 s are left out. The four kmock-cluster files (e2e/, tests/operator/test_e2e_*
# but autoscale) are those seconds scaled by what e2e/kmock_memo.py saved them in a run
# of tests/operator, tests/gateway and e2e (their time with it over their time
# without). Only the order depends on these: stale values cost time, not correctness.
FILE_SECONDS = {
    "tests/server/test_tensor_parallel.py": 88,
    "tests/server/test_hostile.py": 58,
    "tests/server/test_serve_cli.py": 44,
    "tests/gateway/test_e2e_pools.py": 42,
    "e2e/test_user_path.py": 34,
    "tests/gateway/test_e2e_admission.py": 34,
    "tests/server/test_parity.py": 31,
    "tests/server/test_api_load.py": 29,
    "tests/server/test_api_parity.py": 26,
    "e2e/test_scale_from_zero.py": 24,
    "tests/server/test_lm_eval.py": 22,
    "tests/gateway/test_e2e_failover.py": 21,
    "tests/server/test_api.py": 20,
    "tests/server/test_quant_config.py": 20,
    "tests/deploy/test_chart.py": 18,
    "tests/operator/test_ha.py": 18,
    "tests/server/test_async_scheduling.py": 16,
    "tests/operator/test_e2e_autoscale.py": 11,
    "tests/server/test_quant_engine.py": 11,
    "tests/server/test_schema_fuzz.py": 11,
    "tests/operator/test_e2e_production.py": 10,
    "tests/server/test_structured_output.py": 10,
    "tests/server/test_demo_model.py": 9,
    "tests/operator/test_cli.py": 9,
    "tests/operator/test_inferencepool.py": 6,
    "tests/gateway/test_e2e_affinity.py": 6,
    "tests/server/test_bench_serve.py": 5,
    "tests/operator/test_e2e_reconcile.py": 5,
    # SPREAD files: the order their tests are handed out in, longest first
    # two sm_90 compiles of every kernel (~45 s of CPU each on a fresh machine, no
    # Triton cache): first, so neither is the last unit of a worker
    "tests/server/test_kernels_compile.py": 95,
    "tests/server/test_kernels_warmup.py": 91,
    "tests/server/test_kernels_prefill.py": 70,
    "tests/server/test_kernels_model.py": 65,
    "tests/server/test_quant_kernels_w4_gemv_loads.py": 62,
    "tests/server/test_quant_kernels_fp8.py": 37,
    "tests/server/test_quant_kernels_w4.py": 31,
    "tests/server/test_quant_kernels_split_k.py": 23,
    "tests/server/test_kernels_decode.py": 22,
}


def _spread(nodeid: str) -> bool:
    return nodeid.startswith(SPREAD)


def pytest_collection_modifyitems(config, items):
    """In xdist workers: the order above (the scheduler below hands out work units in
    the workers' collection order). A run without xdist keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {id(item): i for i, item in enumerate(items)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return _spread(item.nodeid), -FILE_SECONDS.get(path, 0), rank[id(item)]

    items.sort(key=key)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """loadfile, with each test of a SPREAD file a work unit of its own and the work
    units in collection order (not xdist's default: most tests first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadKernelTests(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if _spread(nodeid) else super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return SpreadKernelTests(config, log)
