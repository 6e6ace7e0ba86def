"""The reconcile and autoscale steps: I/O around the pure parts.

`reconcile` makes the children match the spec (on create, update, resume);
`evaluate` runs one autoscaler/status round (every intervalSeconds). Both are
plain async functions over a `KubeClient`, so kopf is only the trigger
(`handlers.py`). Per-resource state (the recommendation history, the last scale
time) lives in a `State` the caller keeps in memory, like the HPA controller does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from pagefleet.operator import autoscale, crd, metrics, resources, status
from pagefleet.operator.kube import KubeClient, KubeError, object_path, path_for
from pagefleet.operator.spec import DEFAULT_IMAGE, ModelDeploymentSpec, SpecError, parse_spec

log = logging.getLogger("pagefleet.operator")


@dataclasses.dataclass
class State:
    """In-memory state of one ModelDeployment (lost on restart, by design)."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    history: tuple[autoscale.Recommendation, ...] | None = None
    scale_ups: tuple[autoscale.ScaleUp, ...] = ()
    last_scale_time: str | None = None
    last_error: str | None = None
    deleting: bool = False          # set by the delete handler: stop touching children


@dataclasses.dataclass(frozen=True)
class Settings:
    default_image: str = DEFAULT_IMAGE
    scrape_timeout: float = metrics.DEFAULT_TIMEOUT_S


def cr_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path_for(crd.API_VERSION, crd.PLURAL, namespace, name, subresource)


def deployment_path(namespace: str, name: str) -> str:
    return path_for("apps/v1", "deployments", namespace, name)


def children(spec: ModelDeploymentSpec, replicas: int) -> list[dict[str, Any]]:
    return [resources.deployment(spec, replicas), resources.service(spec),
            resources.pod_disruption_budget(spec)]


async def apply(kube: KubeClient, desired: Mapping[str, Any]) -> dict[str, Any]:
    """Create, or merge-patch what differs from what we applied last time."""
    path = object_path(desired)
    live = await kube.get(path)
    if live is None:
        collection = path.rsplit("/", 1)[0]
        return await kube.create(collection, resources.with_last_applied(desired))
    return await kube.patch(path, resources.apply_patch(live, desired))


async def write_status(kube: KubeClient, body: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    if status.same_status(body.get("status"), new):
        return
    meta = body["metadata"]
    await kube.patch(cr_path(meta["namespace"], meta["name"], "status"), {"status": dict(new)})


async def report_invalid(kube: KubeClient, body: Mapping[str, Any], state: State, err: SpecError,
                         deployment: Mapping[str, Any] | None) -> None:
    """Degraded + one Warning Event per distinct error; never an exception (a bad CR
    must not be retried forever)."""
    meta = body["metadata"]
    message = str(err)
    if state.last_error != message:
        state.last_error = message
        log.warning("%s/%s: invalid spec: %s", meta.get("namespace"), meta.get("name"), message)
        await kube.post_event(body, "Warning", "InvalidSpec", message)
    desired = int(((deployment or {}).get("spec") or {}).get("replicas") or 0)
    conds = status.error_conditions("InvalidSpec", message, deployment, desired)
    new = status.build_status(old=body.get("status"), generation=meta.get("generation"),
                              deployment=deployment, desired=None, waiting=None, selector=None,
                              endpoint=None, last_scale_time=None, conditions=conds, now=status.now_iso())
    await write_status(kube, body, new)


def _deleting(body: Mapping[str, Any], state: State) -> bool:
    return state.deleting or bool(body["metadata"].get("deletionTimestamp"))


async def reconcile(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings) -> None:
    """Make Deployment, Service and PDB match the spec. Raises KubeError on API
    failures (the caller retries); reports an invalid spec instead of raising."""
    meta = body["metadata"]
    async with state.lock:
        if _deleting(body, state):
            return
        try:
            spec = parse_spec(body, default_image=settings.default_image)
        except SpecError as err:
            live = await kube.get(deployment_path(meta["namespace"], meta["name"]))
            await report_invalid(kube, body, state, err, live)
            return
        state.last_error = None
        live = await kube.get(deployment_path(spec.namespace, spec.name))
        live_replicas = None if live is None else (live.get("spec") or {}).get("replicas")
        replicas = resources.initial_replicas(spec, live_replicas)
        deployment = None
        for obj in children(spec, replicas):
            applied = await apply(kube, obj)
            if obj["kind"] == "Deployment":
                deployment = applied
        if live is None:
            await kube.post_event(body, "Normal", "Created",
                                  f"created Deployment, Service and PodDisruptionBudget {spec.name} "
                                  f"with {replicas} replica(s)")
        new = status.build_status(
            old=body.get("status"), generation=spec.generation, deployment=deployment, desired=replicas,
            waiting=None, selector=resources.selector_string(spec.name), endpoint=resources.endpoint(spec),
            last_scale_time=state.last_scale_time,
            conditions=status.deployment_conditions(deployment, replicas), now=status.now_iso())
        await write_status(kube, body, new)


async def cleanup(kube: KubeClient, namespace: str, name: str) -> list[str]:
    """Delete the children explicitly. Owner references make a real cluster's GC do
    the same; this also covers API servers without GC and orphaning deletes."""
    deleted = []
    for api_version, plural in (("apps/v1", "deployments"), ("v1", "services"),
                                ("policy/v1", "poddisruptionbudgets")):
        if await kube.delete(path_for(api_version, plural, namespace, name)):
            deleted.append(plural)
    return deleted


async def evaluate(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings,
                   now: float | None = None) -> float:
    """One autoscale + status round. Returns the seconds until the next one."""
    meta = body["metadata"]
    now = time.monotonic() if now is None else now
    async with state.lock:
        if _deleting(body, state):
            return 1.0
        try:
            spec = parse_spec(body, default_image=settings.default_image)
        except SpecError as err:
            live = await kube.get(deployment_path(meta["namespace"], meta["name"]))
            await report_invalid(kube, body, state, err, live)
            return float(autoscale.AutoscalingSpec().interval_seconds)
        interval = float(spec.autoscaling.interval_seconds)
        deployment = await kube.get(deployment_path(spec.namespace, spec.name))
        if deployment is None:
            needs_reconcile = True
        else:
            needs_reconcile = False
            current = int((deployment.get("spec") or {}).get("replicas") or 0)
            pods = await kube.list(path_for("v1", "pods", spec.namespace),
                                   resources.selector_labels(spec.name))
            pods = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
            samples = await metrics.sample_pods(pods, spec.autoscaling.metric, settings.scrape_timeout)
            reported = [s.value for s in samples if s.ready and s.value is not None]
            waiting = float(sum(reported))
            desired = spec.replicas
            if spec.autoscaling.enabled:
                if state.history is None:
                    state.history = autoscale.seed_history(current, now)
                decision = autoscale.decide(samples, current, state.history, spec.autoscaling,
                                            now, state.scale_ups)
                state.history, state.scale_ups = decision.history, decision.scale_ups
                desired = decision.replicas
                if decision.replicas != current:
                    deployment = await kube.patch(deployment_path(spec.namespace, spec.name),
                                                  {"spec": {"replicas": decision.replicas}})
                    state.last_scale_time = status.now_iso()
                    log.info("%s/%s: %s", spec.namespace, spec.name, decision.reason)
                    await kube.post_event(body, "Normal", "Scaled", decision.reason)
            else:
                state.history = None  # re-seeded if autoscaling is turned on again
            new = status.build_status(
                old=body.get("status"), generation=spec.generation, deployment=deployment,
                desired=desired, waiting=waiting, selector=resources.selector_string(spec.name),
                endpoint=resources.endpoint(spec), last_scale_time=state.last_scale_time,
                conditions=status.deployment_conditions(deployment, desired), now=status.now_iso())
            await write_status(kube, body, new)
    if needs_reconcile:  # someone deleted the Deployment: put it back
        log.info("%s/%s: Deployment missing, reconciling", spec.namespace, spec.name)
        await reconcile(kube, body, state, settings)
    return interval


async def safe_evaluate(kube: KubeClient, body: Mapping[str, Any], state: State, settings: Settings) -> float:
    """evaluate() for a loop that must keep going: API errors are logged, not raised."""
    try:
        return await evaluate(kube, body, state, settings)
    except (KubeError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        log.warning("%s/%s: evaluation failed: %s", body["metadata"].get("namespace"),
                    body["metadata"].get("name"), e)
        return 5.0
