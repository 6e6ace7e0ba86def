"""What the gateway routes to: models -> pools -> endpoints, as typed immutable specs.

A *model* is a served model name (what clients put in `model`). It has one or more
*pools*: one per ModelDeployment in Kubernetes, each with its own context length
(`max_model_len`, for the long/short split) and rollout `weight`. A pool has
*endpoints*: the replicas (`pagefleet serve` processes) behind it.

Both discovery sources produce a `FleetSpec`: the static YAML file parsed here, and the
Kubernetes watcher (`kube.py`). Parsing is pure and every error names the field.

Static file format (docs/gateway.md has the full reference):

    models:
      - name: qwen2.5-7b
        tokenizer: /models/qwen2.5-7b          # what the servers load (path or repo id)
        pools:
          - name: qwen-short
            max_model_len: 8192
            weight: 90
            endpoints: [http://10.0.0.1:8000, http://10.0.0.2:8000]
          - name: qwen-long
            max_model_len: 32768
            endpoints: [{name: long-0, url: http://10.0.0.3:8000}]
      - name: small                            # one pool: endpoints on the model itself
        endpoints: [http://10.0.0.9:8000]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pagefleet.server.config import ConfigError

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class EndpointSpec:
    name: str          # stable identity: ring position and metric label
    url: str           # base URL without /v1, e.g. http://10.0.0.1:8000


@dataclass(frozen=True)
class PoolSpec:
    name: str
    endpoints: tuple[EndpointSpec, ...] = ()
    max_model_len: int | None = None     # None: learned from the replicas' /v1/models
    block_size: int | None = None        # None: learned from vllm:cache_config_info
    weight: float = 100.0
    max_inflight: int | None = None      # per endpoint; None: the gateway's flag
    scheduling_policy: str = "fcfs"      # 'priority': the servers honour `priority`
    api_key: str | None = None           # key the servers want (else the client's)
    tokenizer: str | None = None         # overrides the model's (a canary's new version)
    chat_template: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    pools: tuple[PoolSpec, ...] = ()
    tokenizer: str | None = None
    chat_template: str | None = None
    root: str | None = None              # shown as `root` in /v1/models
    queue_timeout: float | None = None   # overrides --queue-timeout
    max_num_queued_requests: int | None = None
    scale_from_zero: bool = False        # listed in /v1/models with no ready replica


@dataclass(frozen=True)
class FleetSpec:
    models: tuple[ModelSpec, ...] = field(default_factory=tuple)

    def model(self, name: str) -> ModelSpec | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


# -- parsing -------------------------------------------------------------------------
def _fail(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


def _check_keys(obj: dict, allowed: set[str], path: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _fail(path, f"unknown field(s) {', '.join(unknown)}; expected some of "
                          f"{', '.join(sorted(allowed))}")


def _str(obj: dict, key: str, path: str, default: str | None = None) -> str | None:
    v = obj.get(key, default)
    if v is not None and (not isinstance(v, str) or not v):
        raise _fail(f"{path}.{key}", "must be a non-empty string")
    return v


def _int(obj: dict, key: str, path: str, minimum: int) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _fail(f"{path}.{key}", f"must be an integer >= {minimum}, got {v!r}")
    return v


def _num(obj: dict, key: str, path: str, *, positive: bool) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (positive and v == 0):
        raise _fail(f"{path}.{key}", f"must be a number {'>' if positive else '>='} 0, "
                                     f"got {v!r}")
    return float(v)


def parse_url(value: Any, path: str) -> str:
    """An endpoint URL: http(s)://host:port with no path beyond '/' (or '/v1')."""
    if not isinstance(value, str):
        raise _fail(path, f"must be a URL string, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(path, f"must be an http(s):// URL with a host, got {value!r}")
    try:
        parts.port
    except ValueError:
        raise _fail(path, f"bad port in {value!r}") from None
    if parts.path.rstrip("/") not in ("", "/v1") or parts.query or parts.fragment:
        raise _fail(path, f"must be the server's base URL (no path), got {value!r}")
    return f"{parts.scheme}://{parts.netloc}"


def _endpoint(item: Any, path: str) -> EndpointSpec:
    if isinstance(item, str):
        url = parse_url(item, path)
        return EndpointSpec(name=urlsplit(url).netloc, url=url)
    if not isinstance(item, dict):
        raise _fail(path, "must be a URL or a mapping with url (and optional name)")
    _check_keys(item, {"name", "url"}, path)
    url = parse_url(item.get("url"), f"{path}.url")
    return EndpointSpec(name=_str(item, "name", path) or urlsplit(url).netloc, url=url)


POOL_KEYS = {"name", "endpoints", "max_model_len", "block_size", "weight", "max_inflight",
             "scheduling_policy", "api_key", "tokenizer", "chat_template"}


def _pool(item: Any, path: str, default_name: str) -> PoolSpec:
    if not isinstance(item, dict):
        raise _fail(path, "must be a mapping")
    _check_keys(item, POOL_KEYS, path)
    eps = item.get("endpoints") or []
    if not isinstance(eps, list):
        raise _fail(f"{path}.endpoints", "must be a list")
    endpoints = tuple(_endpoint(e, f"{path}.endpoints[{i}]") for i, e in enumerate(eps))
    names = [e.name for e in endpoints]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _fail(f"{path}.endpoints", f"duplicate endpoint name(s) {', '.join(dup)}")
    policy = _str(item, "scheduling_policy", path, "fcfs")
    if policy not in SCHEDULING_POLICIES:
        raise _fail(f"{path}.scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")
    block = _int(item, "block_size", path, 1)
    if block is not None and block not in (8, 16, 32, 64, 128):
        raise _fail(f"{path}.block_size", "must be one of 8, 16, 32, 64, 128")
    weight = _num(item, "weight", path, positive=False)
    return PoolSpec(name=_str(item, "name", path) or default_name, endpoints=endpoints,
                    max_model_len=_int(item, "max_model_len", path, 1), block_size=block,
                    weight=100.0 if weight is None else weight,
                    max_inflight=_int(item, "max_inflight", path, 1),
                    scheduling_policy=policy, api_key=_str(item, "api_key", path),
                    tokenizer=_str(item, "tokenizer", path),
                    chat_template=_str(item, "chat_template", path))


MODEL_KEYS = {"name", "pools", "tokenizer", "chat_template", "root", "queue_timeout",
              "max_num_queued_requests", "scale_from_zero"}


def _model(item: Any, path: str) -> ModelSpec:
    if not isinstance(item, dict):
        raise _fail(path, "must be a mapping")
    pool_keys_here = POOL_KEYS - {"name", "tokenizer", "chat_template"}
    _check_keys(item, MODEL_KEYS | pool_keys_here, path)
    name = _str(item, "name", path)
    if not name:
        raise _fail(f"{path}.name", "is required (the served model name clients send)")
    inline = {k: item[k] for k in pool_keys_here if k in item}
    if "pools" in item and inline:
        raise _fail(path, f"give either pools or {', '.join(sorted(inline))} on the model, "
                          "not both")
    if "pools" in item:
        raw = item["pools"]
        if not isinstance(raw, list) or not raw:
            raise _fail(f"{path}.pools", "must be a non-empty list")
        pools = tuple(_pool(p, f"{path}.pools[{i}]", f"{name}-{i}") for i, p in enumerate(raw))
    else:
        pools = (_pool(inline, path, name),)
    names = [p.name for p in pools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _fail(f"{path}.pools", f"duplicate pool name(s) {', '.join(dup)}")
    sfz = item.get("scale_from_zero", False)
    if not isinstance(sfz, bool):
        raise _fail(f"{path}.scale_from_zero", "must be true or false")
    return ModelSpec(name=name, pools=pools, tokenizer=_str(item, "tokenizer", path),
                     chat_template=_str(item, "chat_template", path),
                     root=_str(item, "root", path),
                     queue_timeout=_num(item, "queue_timeout", path, positive=True),
                     max_num_queued_requests=_int(item, "max_num_queued_requests", path, 0),
                     scale_from_zero=sfz)


def parse_fleet(data: Any, source: str = "models file") -> FleetSpec:
    """A loaded YAML document -> FleetSpec (raises ConfigError naming the field)."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise ConfigError(f"{source}: expected a mapping with a 'models' list")
    _check_keys(data, {"models"}, source)
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(data["models"]))
    names = [m.name for m in models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"models: duplicate model name(s) {', '.join(dup)}")
    return FleetSpec(models=models)


def load_fleet_file(path: str) -> FleetSpec:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"--models-file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--models-file {path}: not valid YAML: {e}") from None
    return parse_fleet(data, f"--models-file {path}")
