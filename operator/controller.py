"""The reconcile, evaluate and repair steps: I/O around the pure parts.

`reconcile` makes the children match the spec (on create, update, resume, and when a
child drifted); `evaluate` runs one metrics/autoscaler/OOM/status round (every
intervalSeconds); `repair` answers a child's watch event. All are plain async
functions over a `KubeClient`, so kopf is only the trigger (`handlers.py`).
Per-resource state lives in a `State` the caller keeps in memory; what must survive
an operator restart or failover (autoscaler history, OOM remediation, the resolved
image and template) is kept in the status and on the Deployment.

What the status promises: `observedGeneration` moves only after the Deployment,
Service and PodDisruptionBudget of that generation were all applied; an invalid spec
or a child the API server refuses is `Degraded`/`Stalled` with the API server's
message and a Warning Event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from pagefleet.operator import (
    autoscale,
    crd,
    gateway,
    inferencepool,
    metrics,
    names,
    oom,
    resources,
    serverargs,
    status,
)
from pagefleet.operator.kube import KubeClient, KubeError, object_path, path_for
from pagefleet.operator.spec import (
    DEFAULT_IMAGE,
    AutoscalingSpec,
    ModelDeploymentSpec,
    SpecError,
    parse_spec,
    spec_hash,
)

log = logging.getLogger("pagefleet.operator")
WAITING, RUNNING = autoscale.WAITING, autoscale.RUNNING


@dataclasses.dataclass
class State:
    """In-memory state of one ModelDeployment."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    history: tuple[autoscale.Recommendation, ...] | None = None
    scale_ups: tuple[autoscale.ScaleUp, ...] = ()
    last_scale_time: str | None = None
    failure: status.Failure | None = None
    last_warning: str | None = None     # one Warning Event per distinct problem
    metrics_ok: bool | None = None      # last MetricsAvailable, for its Events
    gateway_ok: bool | None = None      # last word from the gateway (minReplicas 0), for its Events
    idle_start: float | None = None     # scale to zero: the idle window counts from here at least
    saturated_since: float | None = None  # concurrency: since when the replicas have queued
    capacity: float | None = None         # concurrency: learned running per replica
    pool_warning: str | None = None     # one Warning Event per distinct InferencePool problem
    deleting: bool = False              # set by the delete handler: stop touching children


@dataclasses.dataclass
class Settings:
    default_image: str = DEFAULT_IMAGE
    scrape_timeout: float = metrics.DEFAULT_TIMEOUT_S
    session: aiohttp.ClientSession | None = None     # shared scrape session (None: one per round)
    instance: str = "pagefleet-operator"             # Events' reportingInstance
    gateway: gateway.GatewayScraper | None = None    # --gateway-service (scale from zero)
    gie_checked_at: float = -1e9                     # when the InferencePool API was last looked up
    gie_present: bool = False
    gie_recheck_s: float = 30.0


class Conflict(Exception):
    """A child's name is taken by an object this ModelDeployment does not control."""


def cr_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path_for(crd.API_VERSION, crd.PLURAL, namespace, name, subresource)


def deployment_path(namespace: str, name: str) -> str:
    return path_for("apps/v1", "deployments", namespace, name)


def _base_gmu(spec: ModelDeploymentSpec) -> float:
    """The gpuMemoryUtilization the spec asks for (field, extraArgs or server default)."""
    plain = dataclasses.replace(spec, gpu_memory_utilization_override=None)
    return float(serverargs.effective(resources.server_args(plain), "gpu_memory_utilization"))


def resolve(body: Mapping[str, Any], settings: Settings,
            st: Mapping[str, Any] | None = None) -> tuple[ModelDeploymentSpec, oom.OOMState]:
    """The spec as the operator renders it: parsed, with the OOM remediation recorded
    in the status applied (tied to the spec's hash) and the template hash covering it.
    SpecError also when the server would refuse the rendered args (`check_server_args`)."""
    spec = parse_spec(body, default_image=settings.default_image)
    st = body.get("status") if st is None else st
    state = oom.from_status(st, spec.spec_hash, status.from_iso)
    if state.gpu_memory_utilization is not None:
        spec = dataclasses.replace(
            spec, gpu_memory_utilization_override=state.gpu_memory_utilization,
            spec_hash=spec_hash(body["spec"], {"gpuMemoryUtilization": state.gpu_memory_utilization}))
    resources.check_server_args(spec)
    return spec, state


async def cache_access_modes(kube: KubeClient, spec: ModelDeploymentSpec) -> list[str] | None:
    """The model cache PVC's access modes; None when there is none to read."""
    if spec.model_cache is None:
        return None
    try:
        pvc = await kube.get(path_for("v1", "persistentvolumeclaims", spec.namespace,
                                      spec.model_cache.claim_name))
    except KubeError as e:
        log.warning("%s/%s: cannot read the model cache PVC: %s", spec.namespace, spec.name, e)
        return None
    return list(((pvc or {}).get("spec") or {}).get("accessModes") or []) if pvc else None


def cache_condition(spec: ModelDeploymentSpec, modes: Sequence[str] | None) -> dict[str, Any] | None:
    if spec.model_cache is None:
        return None
    claim = spec.model_cache.claim_name
    if modes is None:
        return status.condition("CacheShared", None, "ClaimNotFound",
                                f"PVC {claim} not found or not readable: rollouts do not surge (maxSurge 0) "
                                "unless spec.rollout says so")
    if set(modes) <= resources.SINGLE_NODE_MODES:
        return status.condition("CacheShared", False, "SingleNodeAccessMode",
                                f"PVC {claim} is {', '.join(modes)}: every replica must run on the node "
                                "that mounts it and rollouts do not surge (maxSurge 0); "
                                "use ReadWriteMany or ReadOnlyMany to spread replicas")
    return status.condition("CacheShared", True, "MultiNodeAccessMode", f"PVC {claim} is {', '.join(modes)}")


def children(spec: ModelDeploymentSpec, replicas: int, modes: Sequence[str] | None,
             live: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Deployment, Service, PDB. A Deployment rendered from the same spec hash keeps
    the template it was applied with (image and operator defaults of that time)."""
    dep = resources.deployment(spec, replicas, modes)
    frozen = resources.frozen_template(live, spec.spec_hash)
    if frozen is not None:
        dep["spec"]["template"] = frozen
    return [dep, resources.service(spec), resources.pod_disruption_budget(spec, replicas)]


async def apply(kube: KubeClient, desired: Mapping[str, Any], owner_uid: str | None) -> dict[str, Any]:
    """Create; or, when the live object drifted from `desired`, merge-patch it."""
    path = object_path(desired)
    live = await kube.get(path)
    if live is None:
        return await kube.create(path.rsplit("/", 1)[0], resources.with_last_applied(desired))
    controller = resources.controller_uid(live)
    ours = ((live.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/managed-by") == resources.MANAGER
    if (controller is not None and owner_uid is not None and controller != owner_uid) or (
            controller is None and not ours):
        raise Conflict(f"{desired['kind']} {desired['metadata']['name']} already exists and is not "
                       f"controlled by this ModelDeployment")
    if resources.in_sync(live, desired):
        return live
    return await kube.patch(path, resources.apply_patch(live, desired))


def _stalling(e: Exception) -> bool:
    """Refusals that retrying cannot fix (the spec or the cluster must change)."""
    if isinstance(e, Conflict):
        return True
    return isinstance(e, KubeError) and 400 <= e.status < 500 and e.status not in (404, 408, 409, 429)


async def write_status(kube: KubeClient, body: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    old = body.get("status")
    if status.same_status(old, new):
        return
    meta = body["metadata"]
    await kube.patch(cr_path(meta["namespace"], meta["name"], "status"),
                     {"status": status.status_patch(old, new)})


async def _warn_once(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                     reason: str, message: str) -> None:
    if state.last_warning == message:
        return
    state.last_warning = message
    meta = body["metadata"]
    log.warning("%s/%s: %s: %s", meta.get("namespace"), meta.get("name"), reason, message)
    await kube.post_event(body, "Warning", reason, message, instance=settings.instance)


async def report_failure(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                         failure: status.Failure, deployment: Mapping[str, Any] | None) -> None:
    """Degraded (and Stalled, or Reconciling while it is retried) with the message, one
    Warning Event per distinct message. observedGeneration stays where it was."""
    state.failure = failure
    await _warn_once(kube, body, state, settings, failure.reason, failure.message)
    desired = int(((deployment or {}).get("spec") or {}).get("replicas") or 0)
    conds = status.conditions(deployment=deployment, desired=desired, failure=failure, current=False)
    new = status.build_status(old=body.get("status"), conditions=conds,
                              generation=body["metadata"].get("generation"), now=status.now_iso(),
                              deployment=deployment)
    await write_status(kube, body, new)


def _deleting(body: Mapping[str, Any], state: State) -> bool:
    return state.deleting or bool(body["metadata"].get("deletionTimestamp"))


async def reconcile(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                    fresh: bool = False) -> None:
    """Make Deployment, Service and PDB match the spec. Raises KubeError/Conflict when
    the API server refused a child (after reporting it; the caller retries); reports
    an invalid spec instead of raising. `fresh`: read the ModelDeployment anew first
    (the caller's copy may predate a spec change, and must not roll it back)."""
    meta = body["metadata"]
    async with state.lock:
        if fresh:
            latest = await kube.get(cr_path(meta["namespace"], meta["name"]))
            if latest is None:
                return
            body = latest
        if _deleting(body, state):
            return
        try:
            spec, _ = resolve(body, settings)
        except SpecError as err:
            live = await kube.get(deployment_path(meta["namespace"], names.child_name(meta["name"])))
            await report_failure(kube, body, state, settings, status.Failure("InvalidSpec", str(err), True), live)
            return
        live = await kube.get(deployment_path(spec.namespace, spec.child_name))
        live_replicas = None if live is None else (live.get("spec") or {}).get("replicas")
        replicas = resources.initial_replicas(spec, live_replicas)
        modes = await cache_access_modes(kube, spec)
        try:
            objs = children(spec, replicas, modes, live)
        except SpecError as err:  # spec.rollout that cannot work with the cache PVC
            await report_failure(kube, body, state, settings, status.Failure("InvalidSpec", str(err), True), live)
            return
        deployment = live
        try:
            for obj in objs:
                applied = await apply(kube, obj, spec.uid)
                if obj["kind"] == "Deployment":
                    deployment = applied
        except (KubeError, Conflict) as e:
            await report_failure(kube, body, state, settings,
                                 status.Failure("ApplyFailed", str(e), _stalling(e)), deployment)
            raise
        state.failure = None
        state.last_warning = None
        if live is None:
            await kube.post_event(body, "Normal", "Created",
                                  f"created Deployment, Service and PodDisruptionBudget {spec.child_name} "
                                  f"with {replicas} replica(s)", instance=settings.instance)
        conds = status.conditions(deployment=deployment, desired=replicas, failure=None, current=True)
        cache = cache_condition(spec, modes)
        pool_cond, pool_field = await _inference_pool_status(kube, body, state, settings, spec)
        extra = [c for c in (cache, pool_cond) if c]
        drop = tuple(t for t, c in (("CacheShared", cache), ("InferencePool", pool_cond)) if c is None)
        template = (deployment or {}).get("spec", {}).get("template", {})
        image = next((c.get("image") for c in template.get("spec", {}).get("containers", [])
                      if c.get("name") == resources.CONTAINER_NAME), spec.image)
        new = status.build_status(
            old=body.get("status"), conditions=conds + extra,
            generation=spec.generation, now=status.now_iso(), deployment=deployment,
            drop=drop, inferencePool=pool_field,
            observedGeneration=spec.generation, desiredReplicas=replicas,
            selector=resources.selector_string(spec.child_name), endpoint=resources.endpoint(spec),
            serverImage=image, templateHash=spec.spec_hash, lastScaleTime=state.last_scale_time)
        await write_status(kube, body, new)


async def inference_pools_installed(kube: KubeClient, settings: Settings) -> bool:
    """Is the InferencePool API served? The discovery document of its group version
    (no RBAC needed). A yes is trusted for `gie_recheck_s`; a no is looked up again at
    the next reconcile, so a CRD installed later is picked up without a restart."""
    now = time.monotonic()
    if not settings.gie_present or now - settings.gie_checked_at >= settings.gie_recheck_s:
        try:
            doc = await kube.get(f"/apis/{crd.GIE_API_VERSION}")
        except KubeError as e:
            log.warning("cannot read the API discovery of %s: %s", crd.GIE_API_VERSION, e)
            doc = None
        settings.gie_present = inferencepool.api_has_inference_pools(doc)
        settings.gie_checked_at = now
    return settings.gie_present


@dataclasses.dataclass(frozen=True)
class PoolResult:
    """What became of the InferencePools of a namespace: per ModelDeployment that asks
    for one, its pool's name or why there is none."""

    installed: bool
    pools: Mapping[str, str]          # ModelDeployment name -> InferencePool name
    error: str | None = None


async def sync_inference_pools(kube: KubeClient, namespace: str, settings: Settings,
                               exclude: str | None = None) -> PoolResult:
    """Make the namespace's InferencePools those its ModelDeployments ask for (create,
    update, delete the ones the operator made that nobody asks for any more).
    `exclude`: a ModelDeployment being deleted."""
    if not await inference_pools_installed(kube, settings):
        return PoolResult(False, {})
    specs = []
    for body in await kube.list(path_for(crd.API_VERSION, crd.PLURAL, namespace)):
        meta = body.get("metadata") or {}
        if meta.get("name") == exclude or meta.get("deletionTimestamp"):
            continue
        try:
            specs.append(resolve(body, settings)[0])
        except SpecError:
            continue  # reported by its own reconcile
    want = inferencepool.desired(specs, namespace)
    members = {s.name: inferencepool.pool_name(s.served_model_name) for s in specs if s.gateway.inference_pool}
    try:
        live = await kube.list(path_for(crd.GIE_API_VERSION, crd.GIE_PLURAL, namespace),
                               {"app.kubernetes.io/managed-by": resources.MANAGER})
        for obj in want.values():
            await apply(kube, obj, None)
        for obj in live:
            name = obj["metadata"]["name"]
            if name not in want and inferencepool.ours(obj):
                await kube.delete(path_for(crd.GIE_API_VERSION, crd.GIE_PLURAL, namespace, name))
                log.info("%s: deleted InferencePool %s (no ModelDeployment asks for it)", namespace, name)
    except (KubeError, Conflict) as e:
        return PoolResult(True, members, str(e))
    return PoolResult(True, members)


def pool_condition(spec: ModelDeploymentSpec, result: PoolResult) -> dict[str, Any]:
    if not result.installed:
        return status.condition("InferencePool", False, "CRDNotInstalled",
                                f"the InferencePool API ({crd.GIE_PLURAL}.{crd.GIE_GROUP}, "
                                f"{crd.GIE_VERSION}) is not installed: no InferencePool emitted")
    if result.error is not None:
        return status.condition("InferencePool", False, "ApplyFailed", result.error)
    name = result.pools.get(spec.name, inferencepool.pool_name(spec.served_model_name))
    return status.condition("InferencePool", True, "Applied",
                            f"InferencePool {name} selects the pods of model {spec.served_model_name} "
                            f"in {spec.namespace}; endpoint picker {spec.gateway.endpoint_picker.name}"
                            if spec.gateway.endpoint_picker else f"InferencePool {name}")


async def _inference_pool_status(kube: KubeClient, body: Mapping[str, Any], state: State,
                                 settings: Settings, spec: ModelDeploymentSpec) -> tuple[dict[str, Any] | None, Any]:
    """Sync the namespace's pools; the InferencePool condition and status field of
    this ModelDeployment (None / UNSET when it asks for none)."""
    try:
        result = await sync_inference_pools(kube, spec.namespace, settings)
    except (KubeError, aiohttp.ClientError, OSError) as e:
        result = PoolResult(True, {}, str(e))
    if not spec.gateway.inference_pool:
        if result.error:   # someone else's pool; reported on the ModelDeployments that ask for one
            log.info("%s: InferencePool sync failed: %s", spec.namespace, result.error)
        return None, status.UNSET
    cond = pool_condition(spec, result)
    if cond["status"] != "True":
        if state.pool_warning != cond["message"]:
            state.pool_warning = cond["message"]
            await kube.post_event(body, "Warning", "InferencePool", cond["message"], instance=settings.instance)
        return cond, status.UNSET
    state.pool_warning = None
    return cond, result.pools.get(spec.name)


async def cleanup(kube: KubeClient, namespace: str, name: str,
                  settings: Settings | None = None) -> list[str]:
    """Delete the children explicitly. Owner references make a real cluster's GC do
    the same; this also covers API servers without GC and orphaning deletes. The
    namespace's InferencePools are synced without this ModelDeployment (its model's
    pool loses it as an owner, or goes with its last one)."""
    deleted = []
    child = names.child_name(name)
    for api_version, plural in (("apps/v1", "deployments"), ("v1", "services"),
                                ("policy/v1", "poddisruptionbudgets")):
        if await kube.delete(path_for(api_version, plural, namespace, child)):
            deleted.append(plural)
    if settings is not None:
        # Never blocks the deletion (the finalizer): on a real cluster the garbage
        # collector removes a pool whose last owner is gone anyway.
        try:
            result = await sync_inference_pools(kube, namespace, settings, exclude=name)
            error = result.error
        except (KubeError, aiohttp.ClientError, OSError) as e:
            error = str(e)
        if error:
            log.warning("%s/%s: InferencePool sync on delete failed: %s", namespace, name, error)
    return deleted


def _drifted(live: Mapping[str, Any], template_hash: str) -> bool:
    """Hand-edited since the operator applied it, or rendered from another spec."""
    applied = resources.last_applied(live)
    if applied is None:
        return True
    # spec.replicas is not compared: the autoscaler owns it (evaluate() checks it
    # against spec.replicas when autoscaling is off).
    want = {"apiVersion": live.get("apiVersion"), "kind": live.get("kind"),
            "metadata": {**applied.get("metadata", {}), "annotations": {}},
            "spec": {k: v for k, v in (applied.get("spec") or {}).items() if k != "replicas"}}
    if want["metadata"].get("ownerReferences") is None:
        want["metadata"].pop("ownerReferences", None)
    hash_now = ((live.get("metadata") or {}).get("annotations") or {}).get(resources.TEMPLATE_HASH)
    return not resources.in_sync(live, want) or (
        live.get("kind") == "Deployment" and hash_now != template_hash)


async def evaluate(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                   pods: Sequence[Mapping[str, Any]] | None = None, now: float | None = None) -> float:
    """One metrics + autoscale + OOM + status round. Returns the seconds until the
    next one. `pods`: the ModelDeployment's pods from the operator's watch cache (a
    LIST when not given)."""
    meta = body["metadata"]
    now = time.time() if now is None else now
    needs_reconcile, new_status = False, None
    async with state.lock:
        # Read anew under the lock: kopf's copy lags the watch, and a status built on
        # it right after a reconcile wrote observedGeneration/serverImage would write
        # the old values back (the merge patch carries every status key), leaving the
        # resource Reconciling for good.
        latest = await kube.get(cr_path(meta["namespace"], meta["name"]))
        if latest is None:
            return 1.0
        body = latest
        if _deleting(body, state):
            return 1.0
        try:
            spec, oom_state = resolve(body, settings)
        except SpecError as err:
            live = await kube.get(deployment_path(meta["namespace"], names.child_name(meta["name"])))
            await report_failure(kube, body, state, settings, status.Failure("InvalidSpec", str(err), True), live)
            return float(AutoscalingSpec().interval_seconds)
        policy = spec.autoscaling
        interval = float(policy.interval_seconds)
        deployment = await kube.get(deployment_path(spec.namespace, spec.child_name))
        hand_scaled = (deployment is not None and not policy.enabled
                       and (deployment.get("spec") or {}).get("replicas") != spec.replicas)
        if deployment is None or hand_scaled or _drifted(deployment, spec.spec_hash):
            needs_reconcile = True
        else:
            current = int((deployment.get("spec") or {}).get("replicas") or 0)
            if pods is None:
                pods = await kube.list(path_for("v1", "pods", spec.namespace),
                                       resources.selector_labels(spec.child_name))
            pods = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
            samples = await metrics.sample_pods(pods, policy.samples, settings.scrape_timeout,
                                                settings.session, extra=(WAITING, RUNNING))
            metrics_cond = status.metrics_condition(samples, policy.metric, resources.PORT)
            await _metrics_events(kube, body, state, settings, metrics_cond)
            desired, fields = spec.replicas, {}
            extra_conds: list[dict[str, Any]] = []
            if policy.enabled:
                signal, view = await _gateway_signal(kube, body, state, settings, spec)
                desired, fields = await _autoscale(kube, body, state, settings, spec, samples,
                                                   current, deployment, now, signal, view)
                deployment = fields.pop("_deployment")
                zero_reason = fields.pop("_zero_reason")
                fields["gatewayWaitingRequests"] = signal.waiting if signal else status.UNSET
                fields["lastRequestTime"] = (status.to_iso(signal.last_request)
                                             if signal and signal.last_request else status.UNSET)
                if policy.scales_to_zero:
                    extra_conds.append(status.active_condition(
                        gateway=settings.gateway.describe() if settings.gateway else None,
                        replicas=desired, signal=signal, errors=view.errors if view else (),
                        reason=zero_reason, namespace=spec.namespace))
            else:
                state.history = None  # re-seeded (from status) if autoscaling is turned on again
                fields["autoscaler"] = status.UNSET
                fields["gatewayWaitingRequests"] = fields["lastRequestTime"] = status.UNSET
            oom_fields, oom_cond, lowered = await _oom(kube, body, state, settings, spec, oom_state, pods, now)
            needs_reconcile = lowered
            reported = [s for s in samples if s.ready and s.value is not None]
            waiting = [s.values[WAITING] for s in samples if s.ready and WAITING in s.values]
            running = [s.values[RUNNING] for s in samples if s.ready and RUNNING in s.values]
            observed = (body.get("status") or {}).get("observedGeneration")
            current_gen = spec.generation is None or observed == spec.generation
            conds = status.conditions(deployment=deployment, desired=desired, failure=state.failure,
                                      current=current_gen and state.failure is None)
            new_status = status.build_status(
                old=body.get("status"), conditions=conds + [metrics_cond, oom_cond] + extra_conds,
                generation=spec.generation, now=status.now_iso(), deployment=deployment,
                drop=() if extra_conds else ("Active",),
                desiredReplicas=desired, selector=resources.selector_string(spec.child_name),
                endpoint=resources.endpoint(spec), lastScaleTime=state.last_scale_time,
                waitingRequests=sum(waiting) if waiting else status.UNSET,
                runningRequests=sum(running) if running else status.UNSET,
                metricValue=(sum(s.value for s in reported) / len(reported)) if reported else status.UNSET,
                oomRemediation=oom_fields, **fields)
            await write_status(kube, body, new_status)
    if needs_reconcile:  # a child was deleted or edited, or the template must change
        log.info("%s/%s: children out of date, reconciling", spec.namespace, spec.name)
        await reconcile(kube, body, state, settings, fresh=True)
    return interval


async def _metrics_events(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                          cond: Mapping[str, Any]) -> None:
    ok = {"True": True, "False": False}.get(cond["status"])
    if ok is None or ok == state.metrics_ok:
        return
    if ok is False:
        await kube.post_event(body, "Warning", "MetricsUnavailable", cond["message"], instance=settings.instance)
    elif state.metrics_ok is False:
        await kube.post_event(body, "Normal", "MetricsAvailable", cond["message"], instance=settings.instance)
    state.metrics_ok = ok


async def _gateway_signal(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                          spec: ModelDeploymentSpec) -> tuple[gateway.PoolSignal | None, gateway.View | None]:
    """The gateway's counts for this pool (None without a gateway, or when no replica
    of it could be read or watches this namespace). Events when it stops or resumes
    answering, for models that scale to zero (they depend on it)."""
    if settings.gateway is None:
        return None, None
    session = settings.session or metrics.new_session()
    try:
        view = await settings.gateway.view(session)
    finally:
        if settings.session is None:
            await session.close()
    signal = gateway.pool_signal(view, spec.namespace, spec.name, spec.served_model_name)
    if spec.autoscaling.scales_to_zero:
        ok = view.ok and signal is not None
        if ok != state.gateway_ok:
            if not ok:
                why = view.errors[0] if view.errors else f"no gateway replica watches namespace {spec.namespace}"
                await kube.post_event(body, "Warning", "GatewayMetricsUnavailable",
                                      f"cannot read the gateway ({settings.gateway.describe()}): {why}; "
                                      "holding the size (no scale from or to zero)", instance=settings.instance)
            elif state.gateway_ok is False:
                await kube.post_event(body, "Normal", "GatewayMetricsAvailable",
                                      f"reading the gateway ({settings.gateway.describe()}) again",
                                      instance=settings.instance)
            state.gateway_ok = ok
    return signal, view


def _server_load(samples: Sequence[autoscale.PodSample]) -> float | None:
    """Requests running or waiting on the ready pods; None when a ready pod did not
    say (its load is unknown)."""
    total = 0.0
    for s in samples:
        if not s.ready:
            continue
        if WAITING not in s.values or RUNNING not in s.values:
            return None
        total += s.values[WAITING] + s.values[RUNNING]
    return total


async def _autoscale(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                     spec: ModelDeploymentSpec, samples: Sequence[autoscale.PodSample], current: int,
                     deployment: dict[str, Any], now: float, signal: gateway.PoolSignal | None = None,
                     view: gateway.View | None = None) -> tuple[int, dict[str, Any]]:
    policy = spec.autoscaling
    if state.history is None:
        restored = autoscale.history_from_status(body.get("status"), status.from_iso)
        if restored is not None:
            state.history, state.scale_ups = restored
        else:
            state.history = autoscale.seed_history(current, now)
    if state.idle_start is None:
        state.idle_start = now
    zero = autoscale.ZeroDecision(None, "")
    if policy.scales_to_zero:
        load = _server_load(samples)
        if load is None or load > 0 or (signal is not None and (signal.waiting > 0 or signal.inflight > 0)):
            state.idle_start = now        # busy now: the idle window starts over
        zero = autoscale.scale_to_zero(current, policy, signal, bool(view and view.ok), load,
                                       state.idle_start, now)
    if zero.replicas is not None:
        # At zero (or going there) there are no pods to measure: the history starts over.
        ups = tuple(e for e in state.scale_ups if e.at > now - autoscale.SCALE_UP_PERIOD_S)
        if zero.replicas > current:
            ups += (autoscale.ScaleUp(now, zero.replicas - current),)
            state.idle_start = now
        history = state.history if zero.replicas == current else autoscale.seed_history(zero.replicas, now)
        decision = autoscale.Decision(replicas=zero.replicas, recommendation=zero.replicas, waiting=0.0,
                                      reported=0, history=history, reason=zero.reason, scale_ups=ups)
    else:
        held = signal.waiting if signal and policy.metric in (crd.METRIC_CONCURRENCY, crd.METRIC_WAITING) else 0.0
        decision = autoscale.decide(samples, current, state.history, policy, now, state.scale_ups, extra=held,
                                    saturated_since=state.saturated_since, capacity=state.capacity)
    state.history, state.scale_ups = decision.history, decision.scale_ups
    state.saturated_since, state.capacity = decision.saturated_since, decision.capacity
    if decision.replicas != current:
        deployment = await kube.patch(deployment_path(spec.namespace, spec.child_name),
                                      {"spec": {"replicas": decision.replicas}})
        if (current <= 1) != (decision.replicas <= 1):  # the PDB's budget depends on it
            await apply(kube, resources.pod_disruption_budget(spec, decision.replicas), spec.uid)
        state.last_scale_time = status.now_iso()
        log.info("%s/%s: %s", spec.namespace, spec.name, decision.reason)
        await kube.post_event(body, "Normal", "Scaled", decision.reason, instance=settings.instance)
    policy = spec.autoscaling
    # Refresh the stored history every tenth of the shortest window (and at least
    # every interval): a restart can then end a window at most that early.
    windows = [w for w in (policy.scale_down_stabilization_seconds, policy.scale_up_stabilization_seconds) if w > 0]
    refresh = max(float(policy.interval_seconds), 0.1 * min(windows)) if windows else float(policy.interval_seconds)
    kept = autoscale.persisted((body.get("status") or {}).get("autoscaler"), decision.history,
                               decision.scale_ups, now, refresh, status.to_iso, status.from_iso)
    return decision.replicas, {"_deployment": deployment, "autoscaler": kept,
                               "_zero_reason": zero.reason or decision.reason}


async def _oom(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
               spec: ModelDeploymentSpec, oom_state: oom.OOMState, pods: Sequence[Mapping[str, Any]],
               now: float) -> tuple[dict[str, Any], dict[str, Any], bool]:
    exits = oom.oom_exits(pods, resources.CONTAINER_NAME, status.from_iso, spec.spec_hash, resources.TEMPLATE_HASH)
    result = oom.step(oom_state, exits, spec.oom, _base_gmu(spec), now)
    new = result.state
    if result.lowered:
        before, after = result.lowered
        message = (f"{len(result.counted)} OOM exits in {spec.oom.window_seconds}s "
                   f"({', '.join(sorted({e.reason for e in result.counted}))}): lowering "
                   f"gpu-memory-utilization {before:g} -> {after:g} and rolling the pods")
        log.warning("%s/%s: %s", spec.namespace, spec.name, message)
        await kube.post_event(body, "Warning", "OOMRemediation", message, instance=settings.instance)
    elif result.at_floor:
        await _warn_once(kube, body, state, settings, "OOMRemediation",
                         f"{len(result.counted)} OOM exits in {spec.oom.window_seconds}s but "
                         f"gpu-memory-utilization is at the floor {spec.oom.floor:g}: fix the spec "
                         "(maxModelLen, maxNumSeqs, a larger GPU)")
    if new.gpu_memory_utilization is not None:
        cond = status.condition("OOMRemediation", True, "AtFloor" if result.at_floor else
                                "LoweredGpuMemoryUtilization",
                                f"running with gpu-memory-utilization {new.gpu_memory_utilization:g} "
                                f"(spec: {_base_gmu(spec):g}) after repeated OOMs; a spec change resets it")
    else:
        cond = status.condition("OOMRemediation", False, "NotNeeded" if spec.oom.enabled else "Disabled",
                                f"{len(new.ooms)} OOM exit(s) in the last {spec.oom.window_seconds}s")
    return oom.to_status(new, status.to_iso), cond, result.lowered is not None


async def repair(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                 child: Mapping[str, Any], deleted: bool) -> bool:
    """A watched child changed or vanished: put it back when it no longer holds what
    the operator applied. True when it reconciled."""
    if _deleting(body, state):
        return False
    if not deleted and not _drifted(child, ((child.get("metadata") or {}).get("annotations") or {}).get(
            resources.TEMPLATE_HASH, "")):
        return False
    what = f"{child.get('kind')} {(child.get('metadata') or {}).get('name')}"
    log.info("%s/%s: %s %s, reconciling", body["metadata"].get("namespace"), body["metadata"].get("name"),
             what, "deleted" if deleted else "edited")
    await reconcile(kube, body, state, settings, fresh=True)
    await kube.post_event(body, "Normal", "Repaired", f"{what} was {'deleted' if deleted else 'changed'} "
                          "by someone else; re-applied it", instance=settings.instance)
    return True


async def safe_evaluate(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                        pods: Sequence[Mapping[str, Any]] | None = None) -> float:
    """evaluate() for a loop that must keep going: API errors are logged, not raised."""
    try:
        return await evaluate(kube, body, state, settings, pods)
    except (KubeError, Conflict, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        if settings.session is not None and settings.session.closed:
            return 1.0  # the operator is exiting
        log.warning("%s/%s: evaluation failed: %s", body["metadata"].get("namespace"),
                    body["metadata"].get("name"), e)
        return 5.0
