# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target server   -t ghcr.io/pagefleet/pagefleet:0.1.0 .
#   docker build --target operator -t ghcr.io/pagefleet/pagefleet-operator:0.1.0 .
# Versions are pinned (base image and every Python dependency) so a rebuild gives the
# same server: a silent transformers/tokenizers upgrade changes chat templates and
# tokenization (seed reports 002, 003). Bump them here, on purpose, with the tests.

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

# ---------------------------------------------------------------- base
FROM ${PYTHON_IMAGE} AS base
# PYTHONSAFEPATH: `python -c`/`-m` (the build step below, multiprocessing's spawned
# engine core) would otherwise put the working directory first on sys.path, and a
# source tree there shadows the standard library (operator/ is `import operator`).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A fixed non-root uid/gid (the chart's securityContext runs as 10001).
RUN groupadd --system --gid 10001 pagefleet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/pagefleet --create-home pagefleet
# The build context is copied here and installed (not editable); the images then run
# from the user's home, with no source tree in the working directory.
WORKDIR /opt/pagefleet/src

# ---------------------------------------------------------------- operator
# Slim: kopf and the Kubernetes client, no torch.
FROM base AS operator
RUN pip install \
      "pyyaml==6.0.4" \
      "kopf==1.45.2" \
      "kubernetes==37.0.2" \
      "prometheus-client==0.26.0" \
      "aiohttp==3.14.5"
COPY pyproject.toml setup.py README.md ./
COPY server/ server/
COPY operator/ operator/
RUN pip install --no-deps . \
 && pagefleet crd > /dev/null
WORKDIR /home/pagefleet
USER 10001:10001
# kopf's liveness endpoint (the chart's livenessProbe).
EXPOSE 8080
ENTRYPOINT ["pagefleet", "operator"]

# ---------------------------------------------------------------- server
# PyPI's Linux torch wheel is the CUDA build: it brings the CUDA runtime, cuBLAS,
# cuDNN, NCCL and triton as nvidia-* wheels; the node provides only the driver.
# torch 2.11.0 brings Triton 3.6.0, the pair every GPU measurement and parity check in
# BENCHMARKS.md ran on. torch 2.13.0 (Triton 3.9.0) serves correctly (GPU parity equal to
# HF) with bf16 and attention as fast, but compiles the quantized decode kernels slower:
# H200, 2026-12-03, same machine and build, GPU ms a step: AWQ B=1 2.69 against 2.50, B=2
# 4.84 against 3.18, B=8 5.86 against 3.51; fp8 B=1 2.72 against 2.54.
FROM base AS server
ARG TORCH_VERSION=2.11.0
RUN pip install \
      "torch==${TORCH_VERSION}" \
      "transformers==5.24.0" \
      "tokenizers==0.23.3" \
      "safetensors==0.8.0" \
      "huggingface_hub==2.4.0" \
      "jinja2==3.1.6" \
      "fastapi==0.165.0" \
      "uvicorn==0.54.0" \
      "pydantic==2.14.4" \
      "prometheus-client==0.26.0" \
      "httpx==0.28.1" \
      "pyzmq==27.3.0" \
      "msgspec==0.23.0" \
      "xgrammar==0.2.9" \
      "apache-tvm-ffi==0.1.15.post2" \
      "jsonschema-rs==0.60.3" \
      "pyyaml==6.0.4"
COPY pyproject.toml setup.py README.md ./
COPY server/ server/
COPY operator/ operator/
# The built-in demo model (a tiny trained Qwen3, CPU-friendly) is baked in, so
# `pagefleet serve` without a MODEL starts offline, and e2e ModelDeployments can say
# model: /opt/pagefleet/models/demo.
ENV HF_HOME=/models/hf-cache
RUN pip install --no-deps . \
 && mkdir -p /opt/pagefleet/models /models/hf-cache \
 && python -P -c "import os; from pagefleet.server.testing import demo_model_path; os.symlink(demo_model_path(), '/opt/pagefleet/models/demo')" \
 && chown -R 10001:10001 /models/hf-cache
# Downloaded weights live here; mount a PersistentVolumeClaim (spec.modelCache) so
# restarts and new replicas skip the download.
VOLUME ["/models/hf-cache"]
WORKDIR /home/pagefleet
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["pagefleet", "serve"]
