"""An emulated cluster for the e2e suite: kmock's API server plus the controllers
and kubelet it lacks, with real processes behind every pod.

What runs here, in one background thread with its own event loop:

- `ApiServer` (kmock's KubernetesEmulator, extended): stamps uid, resourceVersion,
  generation and creationTimestamp like an API server; registers a resource when its
  CustomResourceDefinition is applied; authorizes ServiceAccount tokens against the
  Roles/ClusterRoles and bindings stored in it (so the RBAC in manifests/ is enforced:
  an operator call the chart does not grant gets 403, recorded in `denied`); and serves
  the Service proxy (`/api/v1/namespaces/NS/services/NAME:PORT/proxy/...`) over the
  Service's EndpointSlices, the way `kubectl proxy` users reach a Service.
- `Kubelet`: plays the Deployment/ReplicaSet controllers and the kubelet. For each
  Deployment it creates Pods (pod-template-hash, owner reference), runs each pod's
  container as a real process from the image's ENTRYPOINT (read from the Dockerfile),
  gives each pod its own loopback IP (127.0.1.N; 127.0.(2+W).N under pytest-xdist
  worker gwW, so two workers' clusters never meet: 0.0.0.0 in args binds the pod's IP,
  so every server keeps port 8000), probes readiness, rolls updates with the
  Deployment's maxSurge/maxUnavailable, terminates pods like Kubernetes (endpoint
  removal, preStop, SIGTERM, grace period, SIGKILL), and writes Deployment status.
  It also keeps EndpointSlices for every Service (the endpointslice controller).

Time is compressed in one place: a preStop `sleep N` waits at most PRESTOP_CAP_S.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import hashlib
import itertools
import json
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps, dicts, enums

from e2e import kmock_memo, smp

kmock_memo.install()   # matching without re-checking the whole request history (kmock_memo.py)

REPO = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "e2e-admin"
SA_PREFIX = "system:serviceaccount:"
PRESTOP_CAP_S = 2.0
TICK_S = 0.2
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PROXY_RE = re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/:]+)(?::([^/]+))?/proxy(/.*)?$")
NAMESPACE_RE = re.compile(r"^/api/v1/namespaces(?:/([^/]+))?/?$")
HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "content-length",
               "te", "trailer", "upgrade", "proxy-authorization", "proxy-authenticate"}


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- images

def dockerfile_entrypoints(dockerfile: Path = REPO / "Dockerfile") -> dict[str, list[str]]:
    """stage name -> ENTRYPOINT (exec form), from the repo's Dockerfile."""
    out: dict[str, list[str]] = {}
    stage = ""
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"\s*FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            stage = (m.group(1) or "").lower()
        m = re.match(r"\s*ENTRYPOINT\s+(\[.*\])", line, re.I)
        if m:
            out[stage] = json.loads(m.group(1))
    return out


def default_images() -> dict[str, list[str]]:
    """Image repository -> the entry point of the Dockerfile target it is built from
    (the repositories the chart and the operator name)."""
    eps = dockerfile_entrypoints()
    return {"ghcr.io/pagefleet/pagefleet": eps["server"],
            "ghcr.io/pagefleet/pagefleet-operator": eps["operator"]}


def image_filesystem() -> dict[str, str]:
    """Paths inside the server image -> where the same content is on this machine."""
    from pagefleet.server.testing import demo_model_path

    return {"/opt/pagefleet/models/demo": str(demo_model_path()),
            # The image's HF_HOME (a VOLUME), here a folder of the test run's own.
            "/models/hf-cache": str(Path(os.environ.get("PAGEFLEET_E2E_HF_HOME") or
                                         Path(__file__).resolve().parents[1] / ".e2e-hf-cache"))}


# ---------------------------------------------------------------- RBAC

def _verb(request: Any) -> str | None:
    action = request.action
    if action == enums.action.LIST:
        return "list"
    if action == enums.action.WATCH:
        return "watch"
    if action == enums.action.FETCH:
        return "get"
    if action == enums.action.CREATE:
        return "create"
    if action == enums.action.DELETE:
        return "delete"
    if action == enums.action.UPDATE:
        return "update" if request.method == enums.method.PUT else "patch"
    return None


def rule_allows(rule: Mapping[str, Any], group: str, resource: str, verb: str) -> bool:
    return ((group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
            and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
            and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", [])))


# ---------------------------------------------------------------- API server

async def forget_refused_create(emulator: kmock.KubernetesEmulator, request: Any,
                                response: aiohttp.web.StreamResponse) -> None:
    """kmock stores a created object before any reaction answers; when a reaction
    refused the create (a test's 422), the object is dropped again, with a DELETED
    event for the watchers that saw it added. A real API server stores nothing it
    refuses, so a retry meets the same refusal, not a 409 for the refused copy."""
    if request.resource is None or request.action != enums.action.CREATE or response.status < 400:
        return
    meta = (request.data.get("metadata") or {}) if isinstance(request.data, dict) else {}
    key = (request.resource, request.namespace or meta.get("namespace"), meta.get("name"))
    async with emulator._lock:
        if key not in emulator._objects or emulator._objects[key].deleted:
            return
        obj = emulator._objects[key]
        raw = obj.raw
        obj.delete()
        await emulator._buses[request.resource].put({"type": "DELETED", "object": raw})


# ---------------------------------------------------------------- storage form

# Go `*bool` fields of a pod spec: kept when false. Every other false bool of a pod
# spec is a plain `bool,omitempty` and is dropped when stored.
POINTER_BOOLS = {"automountServiceAccountToken", "enableServiceLinks", "shareProcessNamespace",
                 "setHostnameAsFQDN", "hostUsers", "runAsNonRoot", "privileged",
                 "allowPrivilegeEscalation", "readOnlyRootFilesystem", "optional"}
POINTER_BOOL_PARENTS = {"csi", "azureDisk"}          # their readOnly is a *bool
QUANTITY_MAPS = {"requests", "limits", "overhead"}    # maps of name -> Quantity
QUANTITY_FIELDS = {"sizeLimit", "divisor"}


def _stored_pod_part(value: Any, key: str = "", parent: str = "") -> Any:
    """Part of a pod spec as kube-apiserver serializes it after decoding into Go
    structs: false plain bools, empty strings and empty lists (omitempty) dropped,
    quantities canonical."""
    from pagefleet.operator.quantity import QuantityError, canonical

    def quantity(v: Any) -> Any:
        try:
            return canonical(v) if isinstance(v, (str, int)) and not isinstance(v, bool) else v
        except QuantityError:
            return v

    if isinstance(value, list):
        return [_stored_pod_part(v, "", key) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for k, v in value.items():
        if v is None or v == "" or v == []:
            continue
        if v is False and k not in POINTER_BOOLS and not (k == "readOnly" and key in POINTER_BOOL_PARENTS):
            continue
        if k in QUANTITY_MAPS and isinstance(v, dict):
            out[k] = {name: quantity(q) for name, q in v.items()}
        elif k in QUANTITY_FIELDS:
            out[k] = quantity(v)
        else:
            out[k] = _stored_pod_part(v, k, key)
    return out


def stored_form(obj: Any) -> Any:
    """An object as the API server would store it: the pod spec of a Pod, or the pod
    template of a workload, normalized (`_stored_pod_part`). A client that compares
    what it sent with what it reads back must expect this."""
    if not isinstance(obj, dict) or not isinstance(obj.get("spec"), dict):
        return obj
    out = copy.deepcopy(obj)
    spec = out["spec"]
    if out.get("kind") == "Pod":
        out["spec"] = _stored_pod_part(spec)
    elif isinstance((spec.get("template") or {}).get("spec"), dict):
        spec["template"]["spec"] = _stored_pod_part(spec["template"]["spec"])
    return out


def store_normalized(emulator: kmock.KubernetesEmulator, request: Any) -> None:
    """Rewrite a create or merge patch so that what kmock stores is `stored_form` of
    the result (kmock keeps objects exactly as sent; a real API server does not)."""
    res = request.resource
    if res is None or not isinstance(request.data, dict):
        return
    if request.action == enums.action.CREATE:
        new = stored_form(request.data)
    elif request.action == enums.action.UPDATE and request.name and request.subresource is None:
        try:
            obj = emulator.objects[res, request.namespace, request.name]
        except KeyError:
            return
        if obj.deleted:
            return
        old = dict(obj.raw)
        try:
            merged = dict(dicts.patch_dict(old, request.data))
        except (ValueError, TypeError):
            return
        new = smp.merge_patch(old, stored_form({**merged, "kind": merged.get("kind") or old.get("kind")}))
    else:
        return
    if new is not request.data:
        new = copy.deepcopy(new)
        request.data.clear()
        request.data.update(new)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with the API server behaviour the e2e path relies on."""

    rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    denied: list[tuple[str, str, str, str, str | None]] = attrs.field(factory=list, init=False)  # (user, verb, group, resource, ns)
    used: set[tuple[str, str, str, str]] = attrs.field(factory=set, init=False)  # (user, verb, group, resource)
    proxy_session: aiohttp.ClientSession | None = attrs.field(default=None, init=False)
    proxy_rr: Any = attrs.field(factory=itertools.count, init=False)
    namespaces: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    namespace_watchers: list[asyncio.Queue[dict[str, Any]]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()

    # kmock answers /api/v1 with groupVersion "/v1"; kubectl needs "v1".
    async def _serve_version(self, request: Any) -> Any:
        out = await super()._serve_version(request)
        if isinstance(out, dict) and str(out.get("groupVersion", "")).startswith("/"):
            out["groupVersion"] = out["groupVersion"][1:]
        return out

    def _stored(self, kind_path: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            obj = self.objects[kind_path, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else dict(obj.raw)

    def _list(self, kind_path: str, namespace: str | None = None) -> list[dict[str, Any]]:
        out = []
        for (res, ns, _name), obj in list(self.objects.items()):
            if f"{res.group}/{res.version}/{res.plural}".lstrip("/") == kind_path and not obj.deleted:
                if namespace is None or ns == namespace:
                    out.append(dict(obj.raw))
        return out

    def _authorize(self, user: str, request: Any) -> bool:
        res = request.resource
        verb = _verb(request)
        if res is None or verb is None or not res.plural:
            return True  # discovery and other non-resource URLs
        resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
        group = res.group or ""
        if self._can(user, request.namespace, group, resource, verb):
            return True
        self.denied.append((user, verb, group, resource, request.namespace))
        return False

    def _can(self, user: str, namespace: str | None, group: str, resource: str, verb: str) -> bool:
        """Do the user's Roles/ClusterRoles grant `verb` on `resource`? (The grant is
        recorded as used either way, for the e2e check that every grant is needed.)"""
        self.used.add((user, verb, group, resource))
        ns_name = user[len(SA_PREFIX):].split(":")
        subject = {"kind": "ServiceAccount", "namespace": ns_name[0], "name": ns_name[1]}

        def bound(binding: Mapping[str, Any]) -> bool:
            return any(s.get("kind") == "ServiceAccount" and s.get("name") == subject["name"]
                       and s.get("namespace") == subject["namespace"] for s in binding.get("subjects") or [])

        rules: list[Mapping[str, Any]] = []
        for b in self._list("rbac.authorization.k8s.io/v1/clusterrolebindings"):
            if bound(b):
                role = self._stored("rbac.authorization.k8s.io/v1/clusterroles", None, b["roleRef"]["name"])
                rules += (role or {}).get("rules") or []
        if namespace:
            for b in self._list("rbac.authorization.k8s.io/v1/rolebindings", namespace):
                if bound(b):
                    ref = b["roleRef"]
                    if ref["kind"] == "ClusterRole":
                        role = self._stored("rbac.authorization.k8s.io/v1/clusterroles", None, ref["name"])
                    else:
                        role = self._stored("rbac.authorization.k8s.io/v1/roles", namespace, ref["name"])
                    rules += (role or {}).get("rules") or []
        return any(rule_allows(r, group, resource, verb) for r in rules)

    def _owner_plural(self, api_version: str, kind: str) -> tuple[str, str] | None:
        """(group, plural) of an owner reference's kind, from the served resources."""
        group, _, version = api_version.rpartition("/")
        for key, info in self.resources.items():
            if getattr(info, "kind", None) == kind and (key.group or "") == group and key.version == version:
                return group, key.plural
        return None

    def _block_owner_deletion_allowed(self, user: str, request: Any) -> str | None:
        """The OwnerReferencesPermissionEnforcement admission plugin (on by default in
        OpenShift): setting blockOwnerDeletion needs `update` on the owner's
        `finalizers` subresource. None when allowed, else the API server's message."""
        if request.action not in (enums.action.CREATE, enums.action.UPDATE) or not isinstance(request.data, dict):
            return None
        refs = (request.data.get("metadata") or {}).get("ownerReferences") or []
        old_refs: list[Any] = []
        res = request.resource
        if request.action == enums.action.UPDATE and res is not None and request.name:
            old = self._stored(f"{res.group}/{res.version}/{res.plural}".lstrip("/"), request.namespace,
                               request.name) or {}
            old_refs = (old.get("metadata") or {}).get("ownerReferences") or []
        for ref in refs:
            if not ref.get("blockOwnerDeletion") or ref in old_refs:
                continue
            owner = self._owner_plural(ref.get("apiVersion", ""), ref.get("kind", ""))
            group, plural = owner or ("", str(ref.get("kind")).lower())
            if owner is None or not self._can(user, request.namespace, group, f"{plural}/finalizers", "update"):
                self.denied.append((user, "update", group, f"{plural}/finalizers", request.namespace))
                return (f"cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't "
                        f"set finalizers on: , {ref}")
        return None

    def _stamp(self, request: Any) -> None:
        """uid/resourceVersion/generation/creationTimestamp, as an API server sets them."""
        res = request.resource
        if res is None or not isinstance(request.data, dict):
            return
        if request.action == enums.action.CREATE:
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(next(self.rv))
            meta["generation"] = 1
            meta.setdefault("creationTimestamp", now_iso())
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
        elif request.action == enums.action.UPDATE and request.name:
            kind_path = f"{res.group}/{res.version}/{res.plural}".lstrip("/")
            old = self._stored(kind_path, request.namespace, request.name)
            if old is None:
                return
            meta = request.data.setdefault("metadata", {})
            if isinstance(meta, dict):
                meta["resourceVersion"] = str(next(self.rv))
                if request.subresource is None and "spec" in request.data:
                    try:
                        new = dicts.patch_dict(old, request.data)
                    except (ValueError, TypeError):
                        return
                    if new.get("spec") != old.get("spec"):
                        meta["generation"] = int(old["metadata"].get("generation") or 1) + 1

    def _strategic(self, request: Any) -> None:
        """A strategic merge patch (`kubectl apply` of a changed Deployment) becomes the
        JSON merge patch with the same result (kmock applies only those)."""
        ctype = next((v for k, v in (request.headers or {}).items() if k.lower() == "content-type"), "")
        res = request.resource
        if "strategic-merge-patch" not in ctype or res is None or not isinstance(request.data, dict):
            return
        old = self._stored(f"{res.group}/{res.version}/{res.plural}".lstrip("/"), request.namespace, request.name)
        if old is None:
            return
        patch = smp.merge_patch(old, smp.apply(old, request.data))
        request.data.clear()
        request.data.update(patch)

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for v in spec["versions"]:
            if not v.get("served", True):
                continue
            self.resources[f"{spec['group']}/{v['name']}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"), namespaced=spec["scope"] == "Namespaced",
                shortnames=set(names.get("shortNames") or []), categories=set(names.get("categories") or []),
                verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
                subresources=set((v.get("subresources") or {}).keys()))

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        m = PROXY_RE.match(raw_request.path)
        if m:
            return await self._proxy(raw_request, *m.groups())
        m = NAMESPACE_RE.match(raw_request.path)
        if m:
            return await self._namespace(raw_request, m.group(1))
        return await super().__call__(raw_request)

    async def _namespace(self, raw: aiohttp.web.BaseRequest, name: str | None) -> aiohttp.web.StreamResponse:
        """kmock cannot parse the paths of the cluster-scoped `namespaces` resource;
        Namespaces are kept here (the emulator does not enforce their existence)."""
        def not_found() -> aiohttp.web.StreamResponse:
            return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                              "code": 404, "reason": "NotFound",
                                              "message": f'namespaces "{name}" not found'}, status=404)
        if raw.method == "GET" and name is None and raw.query.get("watch") in ("true", "1"):
            return await self._watch_namespaces(raw)
        if raw.method == "GET" and name is None:
            return aiohttp.web.json_response({"kind": "NamespaceList", "apiVersion": "v1",
                                              "metadata": {"resourceVersion": str(next(self.rv))},
                                              "items": list(self.namespaces.values())})
        if raw.method == "POST":
            body = await raw.json()
            body.setdefault("metadata", {}).update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(),
                                                   resourceVersion=str(next(self.rv)))
            body["status"] = {"phase": "Active"}
            self.namespaces[body["metadata"]["name"]] = body
            self._namespace_event("ADDED", body)
            return aiohttp.web.json_response(body, status=201)
        if name not in self.namespaces:
            return not_found()
        if raw.method == "PATCH":
            self.namespaces[name] = dict(dicts.patch_dict(self.namespaces[name], await raw.json()))
            self.namespaces[name]["metadata"]["resourceVersion"] = str(next(self.rv))
            self._namespace_event("MODIFIED", self.namespaces[name])
        elif raw.method == "DELETE":
            gone = self.namespaces.pop(name)
            self._namespace_event("DELETED", gone)
            return aiohttp.web.json_response(gone)
        return aiohttp.web.json_response(self.namespaces[name])

    def _namespace_event(self, type_: str, obj: dict[str, Any]) -> None:
        for queue in self.namespace_watchers:
            queue.put_nowait({"type": type_, "object": copy.deepcopy(obj)})

    async def _watch_namespaces(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """A watch of Namespaces (kopf's, for namespace patterns): the changes after it
        starts, one JSON line each, until timeoutSeconds or the client goes away."""
        resp = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(raw)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.namespace_watchers.append(queue)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(raw.query.get("timeoutSeconds") or 60)
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                await resp.write(json.dumps(event).encode() + b"\n")
        except (asyncio.CancelledError, ConnectionResetError):
            pass
        finally:
            self.namespace_watchers.remove(queue)
        return resp

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        auth = (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if auth.startswith(SA_PREFIX) and not self._authorize(auth, request):
            res = request.resource
            raise kmock.KubernetesError(
                status=403, reason="Forbidden",
                message=f'{res.plural} is forbidden: User "{auth}" cannot {_verb(request)} resource '
                        f'"{res.plural}" in API group "{res.group}"'
                        + (f' in the namespace "{request.namespace}"' if request.namespace else ""))
        refused = self._block_owner_deletion_allowed(auth, request) if auth.startswith(SA_PREFIX) else None
        if refused:
            raise kmock.KubernetesError(status=403, reason="Forbidden", message=refused)
        self._strategic(request)
        self._stamp(request)
        store_normalized(self, request)
        response = await super()._handle(request)
        res = request.resource
        await forget_refused_create(self, request, response)
        if (res is not None and res.plural == "customresourcedefinitions" and request.action == enums.action.CREATE
                and response.status < 300):
            self._register_crd(request.data)
        return response

    # ------------------------------------------------------------ service proxy

    def service_endpoints(self, namespace: str, service: str, port: str | None) -> list[tuple[str, int]]:
        """Ready (address, port) pairs of a Service's EndpointSlices for a port name/number."""
        svc = self._stored("v1/services", namespace, service)
        if svc is None:
            return []
        ports = svc["spec"].get("ports") or []
        want = next((p for p in ports if port in (None, p.get("name"), str(p.get("port")))), None)
        if want is None:
            return []
        out = []
        for sl in self._list("discovery.k8s.io/v1/endpointslices", namespace):
            if (sl.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL) != service:
                continue
            sl_port = next((p["port"] for p in sl.get("ports") or [] if p.get("name") == want.get("name")), None)
            if sl_port is None:
                continue
            for ep in sl.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready"):
                    out += [(a, int(sl_port)) for a in ep.get("addresses") or []]
        return sorted(out)

    async def _proxy(self, raw: aiohttp.web.BaseRequest, namespace: str, service: str,
                     port: str | None, rest: str | None) -> aiohttp.web.StreamResponse:
        endpoints = self.service_endpoints(namespace, service, port)
        if not endpoints:
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                 "reason": "ServiceUnavailable",
                 "message": f'no endpoints available for service "{service}"'}, status=503)
        address, target_port = endpoints[next(self.proxy_rr) % len(endpoints)]
        if self.proxy_session is None:
            self.proxy_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                                       auto_decompress=False)
        url = f"http://{address}:{target_port}{rest or '/'}"
        headers = {k: v for k, v in raw.headers.items() if k.lower() not in HOP_HEADERS}
        body = await raw.read()
        try:
            async with self.proxy_session.request(raw.method, url, params=raw.query, headers=headers,
                                                  data=body or None) as upstream:
                resp = aiohttp.web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
                await resp.prepare(raw)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as e:
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 502,
                 "reason": "BadGateway", "message": f"error trying to reach service: {e}"}, status=502)


# ---------------------------------------------------------------- kubelet

class Api:
    """A minimal async REST client (admin token) for the controllers."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    async def call(self, method: str, path: str, body: Any = None) -> dict[str, Any] | None:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.session.request(method, self.base + path, json=body, headers=headers) as r:
            if r.status == 404:
                return None
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise RuntimeError(f"{method} {path}: {r.status} {data}")
            return data

    async def items(self, path: str) -> list[dict[str, Any]]:
        return ((await self.call("GET", path)) or {}).get("items") or []

    async def close(self) -> None:
        await self.session.close()


def template_hash(template: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _int_or_percent(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        frac = total * int(value[:-1]) / 100
        return int(-(-frac // 1)) if round_up else int(frac)
    return int(value)


def pod_subnet() -> str:
    """The /24 of loopback this process's pods take: 127.0.1 in a plain run; under
    pytest-xdist, 127.0.(2 + N) for worker gwN, so two workers' clusters (each pod's
    server on port 8000) never share an address."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    m = re.fullmatch(r"gw(\d+)", worker)
    if not m:
        return "127.0.1"
    n = int(m.group(1))
    if n > 253:
        raise RuntimeError(f"no loopback /24 left for xdist worker {worker}")
    return f"127.0.{2 + n}"


class PodRun:
    def __init__(self, namespace: str, name: str, owner: str, hash_: str, ip: str,
                 pod: dict[str, Any]) -> None:
        self.namespace, self.name, self.owner, self.hash, self.ip = namespace, name, owner, hash_, ip
        self.pod = pod
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = False
        self.terminating = False
        self.gone = False
        self.restarts = 0
        self.exit_codes: list[int] = []
        self.task: asyncio.Task[None] | None = None


class Kubelet:
    """Deployments -> Pods -> processes; Services -> EndpointSlices."""

    def __init__(self, api: Api, workdir: Path, api_url: str) -> None:
        self.api = api
        self.workdir = workdir
        self.api_url = api_url
        self.pods: dict[tuple[str, str], PodRun] = {}
        self.images = default_images()
        self.image_fs = image_filesystem()
        self.ips = (f"{pod_subnet()}.{i}" for i in itertools.count(2))
        self.finished: list[PodRun] = []
        self.terminations: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        (workdir / "sa").mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------- loop

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - keep the node alive, report in the test
                self.errors.append(repr(e))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)

    async def tick(self) -> None:
        deployments = await self.api.items("/apis/apps/v1/deployments")
        live = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in deployments}
        for run in list(self.pods.values()):
            if (run.namespace, run.owner) not in live and not run.terminating:
                self.terminate(run)  # garbage collection of an orphaned pod
        for d in deployments:
            await self.reconcile(d)
        await self.sync_endpoints()

    def owned(self, namespace: str, name: str) -> list[PodRun]:
        return [r for r in self.pods.values() if r.namespace == namespace and r.owner == name]

    async def reconcile(self, d: dict[str, Any]) -> None:
        meta, spec = d["metadata"], d["spec"]
        ns, name = meta["namespace"], meta["name"]
        h = template_hash(spec["template"])
        desired = int(spec.get("replicas", 1))
        runs = [r for r in self.owned(ns, name) if not r.terminating]
        new = [r for r in runs if r.hash == h]
        old = [r for r in runs if r.hash != h]
        strategy = spec.get("strategy") or {}
        if strategy.get("type") == "Recreate":
            for r in old:
                self.terminate(r)
            if not [r for r in self.owned(ns, name) if r.hash != h]:
                for _ in range(desired - len(new)):
                    await self.start(d, h)
        else:
            ru = strategy.get("rollingUpdate") or {}
            surge = _int_or_percent(ru.get("maxSurge", "25%"), desired, True)
            unavailable = _int_or_percent(ru.get("maxUnavailable", "25%"), desired, False)
            if surge == 0 and unavailable == 0:
                surge = 1
            if not old:
                for _ in range(desired - len(new)):
                    await self.start(d, h)
            else:
                room = desired + surge - len(runs)
                for _ in range(min(room, desired - len(new))):
                    await self.start(d, h)
                ready = sum(r.ready for r in runs)
                for r in sorted(old, key=lambda r: r.ready):
                    if not r.ready:
                        self.terminate(r)
                    elif ready - 1 >= desired - unavailable:
                        self.terminate(r)
                        ready -= 1
            extra = [r for r in new if not r.terminating][desired:] if len(new) > desired else []
            for r in sorted(new, key=lambda r: r.ready)[:len(extra)]:
                self.terminate(r)
        await self.write_status(d, h)

    async def write_status(self, d: dict[str, Any], h: str) -> None:
        meta = d["metadata"]
        runs = [r for r in self.owned(meta["namespace"], meta["name"]) if not r.terminating]
        desired = int(d["spec"].get("replicas", 1))
        ready = sum(r.ready for r in runs)
        updated = sum(r.hash == h for r in runs)
        complete = updated == desired == len(runs) and ready == desired
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len(runs), "updatedReplicas": updated, "readyReplicas": ready,
            "availableReplicas": ready, "unavailableReplicas": max(0, desired - ready),
            "conditions": [
                {"type": "Available", "status": "True" if ready >= desired else "False",
                 "reason": "MinimumReplicasAvailable" if ready >= desired else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True",
                 "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated"},
            ],
        }
        old = d.get("status") or {}
        if {k: v for k, v in old.items() if k != "conditions"} != {k: v for k, v in status.items() if k != "conditions"} \
                or [c.get("status") for c in old.get("conditions") or []] != [c["status"] for c in status["conditions"]] \
                or [c.get("reason") for c in old.get("conditions") or []] != [c["reason"] for c in status["conditions"]]:
            await self.api.call("PATCH", f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}/status",
                                {"status": status})

    # ---------------------------------------------------------- pods

    async def start(self, d: dict[str, Any], h: str) -> None:
        meta = d["metadata"]
        ns = meta["namespace"]
        template = copy.deepcopy(d["spec"]["template"])
        name = f"{meta['name']}-{h[:8]}-{uuid.uuid4().hex[:5]}"
        ip = next(self.ips)
        labels = dict(template["metadata"].get("labels") or {}, **{"pod-template-hash": h})
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels,
                         "annotations": dict(template["metadata"].get("annotations") or {}),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                              "name": f"{meta['name']}-{h[:8]}", "uid": meta.get("uid", ""),
                                              "controller": True}]},
            "spec": dict(template["spec"], nodeName="e2e-node"),
            "status": {"phase": "Pending", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "False"}]},
        }
        created = await self.api.call("POST", f"/api/v1/namespaces/{ns}/pods", pod)
        run = PodRun(ns, name, meta["name"], h, ip, created or pod)
        self.pods[(ns, name)] = run
        run.task = asyncio.create_task(self.lifecycle(run))

    def kubeconfig_for(self, namespace: str, service_account: str) -> Path:
        path = self.workdir / "sa" / f"{namespace}.{service_account}.kubeconfig"
        if not path.exists():
            write_kubeconfig(path, self.api_url, f"{SA_PREFIX}{namespace}:{service_account}")
        return path

    async def env_for(self, run: PodRun, container: Mapping[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "PYTEST_"))}
        env.pop("KUBECONFIG", None)
        sa = run.pod["spec"].get("serviceAccountName") or "default"
        if run.pod["spec"].get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = str(self.kubeconfig_for(run.namespace, sa))
        env["HOSTNAME"] = run.name
        for e in container.get("env") or []:
            if "value" in e:
                value = str(e["value"])
                for inside, outside in self.image_fs.items():  # paths inside the image
                    value = value.replace(inside, outside) if value.startswith(inside) else value
                env[e["name"]] = value
            elif "secretKeyRef" in (e.get("valueFrom") or {}):
                ref = e["valueFrom"]["secretKeyRef"]
                secret = await self.api.call("GET", f"/api/v1/namespaces/{run.namespace}/secrets/{ref['name']}")
                if secret is None:
                    raise RuntimeError(f"CreateContainerConfigError: secret {ref['name']!r} not found")
                if ref["key"] in (secret.get("data") or {}):
                    env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
                else:
                    env[e["name"]] = secret.get("stringData", {})[ref["key"]]
        return env

    def command_for(self, run: PodRun, container: Mapping[str, Any]) -> list[str]:
        image = container["image"]
        repo = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image
        if container.get("command"):
            cmd = list(container["command"])
        elif repo in self.images:
            cmd = list(self.images[repo])
        else:
            raise RuntimeError(f"ErrImagePull: no image {image!r} on this node")
        if cmd[0] == "pagefleet":
            cmd = [sys.executable, "-m", "pagefleet.server.cli", *cmd[1:]]
        args = []
        for a in container.get("args") or []:
            a = a.replace("0.0.0.0", run.ip)
            for inside, outside in self.image_fs.items():
                a = a.replace(inside, outside)
            args.append(a)
        return cmd + args

    def _port(self, container: Mapping[str, Any], port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return next(int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name") == port)

    async def _patch_pod(self, run: PodRun, body: dict[str, Any]) -> None:
        if not run.gone:
            await self.api.call("PATCH", f"/api/v1/namespaces/{run.namespace}/pods/{run.name}", body)

    async def lifecycle(self, run: PodRun) -> None:
        container = run.pod["spec"]["containers"][0]
        probe = (container.get("readinessProbe") or {}).get("httpGet")
        log = open(self.workdir / "logs" / f"{run.namespace}.{run.name}.log", "ab")
        try:
            while not run.terminating:
                try:
                    cmd = self.command_for(run, container)
                    env = await self.env_for(run, container)
                except RuntimeError as e:
                    await self._patch_pod(run, {"status": {"containerStatuses": [{
                        "name": container["name"], "ready": False, "restartCount": run.restarts,
                        "state": {"waiting": {"reason": str(e).split(":")[0], "message": str(e)}}}]}})
                    await asyncio.sleep(1)
                    continue
                log.write(f"--- {now_iso()} start: {cmd}\n".encode())
                log.flush()
                run.proc = await asyncio.create_subprocess_exec(
                    *cmd, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=str(self.workdir),
                    start_new_session=True)
                await self._patch_pod(run, {"status": {"phase": "Running", "startTime": now_iso(),
                                                      "containerStatuses": [{"name": container["name"], "ready": False,
                                                                             "restartCount": run.restarts, "started": True,
                                                                             "state": {"running": {"startedAt": now_iso()}}}]}})
                await self.probe_until_exit(run, container, probe)
                code = await run.proc.wait()
                run.exit_codes.append(code)
                if run.terminating:
                    break
                run.restarts += 1  # restartPolicy: Always
                run.ready = False
                await self._patch_pod(run, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
                await self.sync_endpoints()
                await asyncio.sleep(min(10, 0.5 * 2 ** run.restarts))
        finally:
            log.close()

    async def probe_until_exit(self, run: PodRun, container: Mapping[str, Any], probe: Mapping[str, Any] | None) -> None:
        assert run.proc is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while run.proc.returncode is None and not run.terminating:
                ok = True
                if probe is not None:
                    url = f"http://{run.ip}:{self._port(container, probe['port'])}{probe.get('path', '/')}"
                    try:
                        async with s.get(url) as r:
                            ok = 200 <= r.status < 400
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        ok = False
                if ok != run.ready and not run.terminating:
                    run.ready = ok
                    await self._patch_pod(run, {"status": {
                        "conditions": [{"type": "Ready", "status": "True" if ok else "False",
                                        "lastTransitionTime": now_iso()}],
                        "containerStatuses": [{"name": container["name"], "ready": ok,
                                               "restartCount": run.restarts, "started": True,
                                               "state": {"running": {}}}]}})
                    await self.sync_endpoints()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(run.proc.wait()), 0.3 if not run.ready else 1.0)

    def terminate(self, run: PodRun) -> None:
        if run.terminating:
            return
        run.terminating = True
        run.ready = False
        task = asyncio.create_task(self._terminate(run))
        self.terminations.add(task)
        task.add_done_callback(self.terminations.discard)

    async def _terminate(self, run: PodRun) -> None:
        spec = run.pod["spec"]
        container = spec["containers"][0]
        with contextlib.suppress(RuntimeError):
            await self._patch_pod(run, {"metadata": {"deletionTimestamp": now_iso(),
                                                     "deletionGracePeriodSeconds": spec.get("terminationGracePeriodSeconds", 30)},
                                        "status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await self.sync_endpoints()
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        prestop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command") or []
        if run.proc is not None and run.proc.returncode is None:
            if prestop[:1] == ["sleep"]:
                await asyncio.sleep(min(float(prestop[1]), PRESTOP_CAP_S))
            with contextlib.suppress(ProcessLookupError):
                run.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(run.proc.wait(), grace)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                await run.proc.wait()
        if run.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run.task, 5)
        with contextlib.suppress(RuntimeError):
            await self.api.call("DELETE", f"/api/v1/namespaces/{run.namespace}/pods/{run.name}")
        run.gone = True
        self.pods.pop((run.namespace, run.name), None)
        self.finished.append(run)
        await self.sync_endpoints()

    async def shutdown(self) -> None:
        for run in list(self.pods.values()):
            self.terminate(run)
        if self.terminations:
            await asyncio.wait(set(self.terminations), timeout=90)
        for run in list(self.pods.values()) + self.finished:  # belt and braces
            if run.proc is not None and run.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)

    # ---------------------------------------------------------- endpoints

    async def sync_endpoints(self) -> None:
        """One EndpointSlice per (Service, port number) with the ready, non-terminating
        pods its selector picks."""
        services = await self.api.items("/api/v1/services")
        slices = await self.api.items("/apis/discovery.k8s.io/v1/endpointslices")
        wanted: dict[tuple[str, str], dict[str, Any]] = {}
        for svc in services:
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            selector = (svc.get("spec") or {}).get("selector")
            if not selector:
                continue
            groups: dict[tuple[tuple[str, int], ...], list[PodRun]] = {}
            for run in self.pods.values():
                labels = run.pod["metadata"].get("labels") or {}
                if run.namespace != ns or run.terminating or not all(labels.get(k) == v for k, v in selector.items()):
                    continue
                container = run.pod["spec"]["containers"][0]
                ports = []
                for p in svc["spec"].get("ports") or []:
                    with contextlib.suppress(StopIteration, KeyError):
                        ports.append((p.get("name", ""), self._port(container, p.get("targetPort", p["port"]))))
                groups.setdefault(tuple(ports), []).append(run)
            for ports, runs in groups.items():
                sl_name = f"{name}-{hashlib.sha256(repr(ports).encode()).hexdigest()[:5]}"
                wanted[(ns, sl_name)] = {
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                    "metadata": {"name": sl_name, "namespace": ns, "labels": {SERVICE_NAME_LABEL: name}},
                    "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
                    "endpoints": [{"addresses": [r.ip], "conditions": {"ready": r.ready, "serving": r.ready,
                                                                       "terminating": False},
                                   "targetRef": {"kind": "Pod", "name": r.name, "namespace": ns}}
                                  for r in sorted(runs, key=lambda r: r.name)]}
        existing = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in slices}
        for key, body in wanted.items():
            cur = existing.get(key)
            if cur is None:
                await self.api.call("POST", f"/apis/discovery.k8s.io/v1/namespaces/{key[0]}/endpointslices", body)
            elif cur.get("endpoints") != body["endpoints"] or cur.get("ports") != body["ports"]:
                await self.api.call("PATCH", f"/apis/discovery.k8s.io/v1/namespaces/{key[0]}/endpointslices/{key[1]}",
                                    {"endpoints": body["endpoints"], "ports": body["ports"]})
        for key in set(existing) - set(wanted):
            await self.api.call("DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{key[0]}/endpointslices/{key[1]}")


# ---------------------------------------------------------------- the cluster

def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    cfg = {"apiVersion": "v1", "kind": "Config", "preferences": {},
           "clusters": [{"name": "e2e", "cluster": {"server": server}}],
           "users": [{"name": "e2e", "user": {"token": token}}],
           "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": "default"}}],
           "current-context": "e2e"}
    path.write_text(yaml.safe_dump(cfg))
    return path


class EmulatedCluster:
    """Start with `with EmulatedCluster(workdir) as c:`; c.url, c.kubeconfig (admin)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._thread, name="e2e-cluster", daemon=True)
        self.ready = threading.Event()
        self.url = ""
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.api_server: ApiServer | None = None
        self.kubelet: Kubelet | None = None
        self._stop: asyncio.Event | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _thread(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - surfaced by __enter__/__exit__
            self._error = e
            self.ready.set()
        finally:
            self._done.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        api_server = ApiServer()
        async with api_server, apps.Server(api_server):
            self.api_server = api_server
            self.url = str(api_server.url).rstrip("/")
            write_kubeconfig(self.kubeconfig, self.url, ADMIN_TOKEN)
            api = Api(self.url)
            self.kubelet = Kubelet(api, self.workdir, self.url)
            runner = asyncio.create_task(self.kubelet.run(self._stop))
            self.ready.set()
            await self._stop.wait()
            await runner
            await self.kubelet.shutdown()
            await api.close()
            if api_server.proxy_session is not None:
                await api_server.proxy_session.close()

    def __enter__(self) -> EmulatedCluster:
        self.thread.start()
        self.ready.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._done.wait(120)

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
