"""A small async Kubernetes REST client: dicts in, dicts out.

Why not the `kubernetes` package's typed API: it is synchronous (a thread per call
inside an asyncio operator) and, in recent releases, validates every body against
its models, while the operator only needs get/list/create/patch/delete of a few
kinds plus Events. Credentials and TLS still come from `kubernetes.config` (in-cluster
service account, else kubeconfig), so every auth method it supports works here.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

MERGE_PATCH = "application/merge-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


def path_for(api_version: str, plural: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    """REST path: ('apps/v1', 'deployments', 'ns', 'x') -> /apis/apps/v1/namespaces/ns/deployments/x."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


PLURALS = {"Deployment": ("apps/v1", "deployments"), "Service": ("v1", "services"),
           "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"), "Pod": ("v1", "pods"),
           "Event": ("v1", "events"), "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
           "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools")}


def object_path(obj: Mapping[str, Any]) -> str:
    api_version, plural = PLURALS[obj["kind"]]
    meta = obj["metadata"]
    return path_for(api_version, plural, meta.get("namespace"), meta["name"])


def labels_match(labels: Mapping[str, str] | None, selector: Mapping[str, str]) -> bool:
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


class KubeClient:
    def __init__(self, host: str, auth: Callable[[], str | None] = lambda: None,
                 ssl_context: ssl.SSLContext | bool | None = None, timeout: float = 30.0) -> None:
        self.host = host.rstrip("/")
        self._auth = auth
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> KubeClient:
        """In-cluster service account if there is one, else kubeconfig ($KUBECONFIG)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        ssl_context: ssl.SSLContext | bool | None = None
        if cfg.host.startswith("https"):
            if cfg.verify_ssl:
                ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            else:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            ssl_context = ctx

        def auth() -> str | None:
            # Re-read each call: service account tokens rotate (refresh hook).
            token = cfg.get_api_key_with_prefix("authorization") or cfg.get_api_key_with_prefix("BearerToken")
            if token:
                return token
            if cfg.username and cfg.password:
                return cfg.get_basic_auth_token()
            return None

        return cls(cfg.host, auth, ssl_context)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._auth()
        if token:
            headers["Authorization"] = token
        return headers

    async def watch(self, path: str, resource_version: str | None = None,
                    timeout_s: int = 300) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch ({"type": ..., "object": ...}) from `resource_version`,
        until the server ends it (after about `timeout_s`). A watch ERROR event (e.g.
        410 Gone: the version is too old, LIST again) is raised as a KubeError."""
        params = {"watch": "true", "timeoutSeconds": str(int(timeout_s)), "allowWatchBookmarks": "true"}
        if resource_version:
            params["resourceVersion"] = resource_version
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=timeout_s + 30)
        async with self._get_session().get(self.host + path, params=params, headers=self._headers(),
                                           ssl=self._ssl, timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(resp.status, "WATCH", path, str(message)[:500])
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    obj = event.get("object") or {}
                    raise KubeError(int(obj.get("code") or 500), "WATCH", path, str(obj.get("message"))[:500])
                yield event

    async def request(self, method: str, path: str, body: Any = None, *,
                      params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._get_session().request(method, self.host + path, data=data, params=params,
                                               headers=headers, ssl=self._ssl) as resp:
            text = await resp.text()
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(resp.status, method, path, str(message)[:500])
            return json.loads(text) if text else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Items matching the label selector. The selector is also applied here,
        because not every API server emulator honours labelSelector."""
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())} if selector else None
        items = (await self.request("GET", path, params=params)).get("items") or []
        if selector:
            items = [i for i in items if labels_match((i.get("metadata") or {}).get("labels"), selector)]
        return items

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body, content_type=MERGE_PATCH)

    async def delete(self, path: str) -> bool:
        """True if it was there."""
        try:
            await self.request("DELETE", path, {"propagationPolicy": "Background"})
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    async def post_event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str,
                         component: str = "pagefleet-operator", instance: str | None = None) -> None:
        """A core/v1 Event with an explicit unique name (some emulators cannot
        generateName)."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name', 'object')}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta.get("name"), "namespace": namespace, "uid": meta.get("uid")},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": instance or component,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await self.create(path_for("v1", "events", namespace), event)
