"""kopf handlers: thin glue from kopf's triggers to `controller`.

- create / update / resume -> controller.reconcile (children match the spec)
- a daemon per ModelDeployment -> controller.evaluate every intervalSeconds
  (metrics, autoscaling, OOM remediation, status), with the pods from a watch cache
  (the `pf_pods` index) instead of a LIST per round
- events of the Deployments, Services and PDBs the operator manages ->
  controller.repair (a deleted or hand-edited child is put back)
- delete -> controller.cleanup (owner references do it on a real cluster too)

Leader election is kopf peering (see `startup`): the replica registered first acts,
the others pause their watches and daemons until it is gone.

Usable both through `pagefleet operator` and as `kopf run -m pagefleet.operator.handlers`.
Handler progress and the diff base are kept in annotations under
operator.pagefleet.dev, so `.status` holds only what DESIGN.md lists.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import os
import time
from typing import Any

import aiohttp
import kopf

from pagefleet.operator import controller, crd, gateway, metrics, names, resources
from pagefleet.operator.kube import KubeClient, KubeError, path_for
from pagefleet.operator.spec import DEFAULT_IMAGE

RESOURCE: dict[str, Any] = {"group": crd.GROUP, "version": crd.VERSION, "plural": crd.PLURAL}
PREFIX = "operator.pagefleet.dev"
IMAGE_ENV = "PAGEFLEET_SERVER_IMAGE"
MANAGED = {"labels": {"app.kubernetes.io/managed-by": resources.MANAGER}}
log = logging.getLogger("pagefleet.operator")


def _state(memo: kopf.Memo, namespace: str, name: str) -> controller.State:
    """Per-ModelDeployment state, shared by its handlers, its daemon and the
    handlers of its children (so they all take the same lock)."""
    states: dict[tuple[str, str], controller.State] = memo.setdefault("pf_states", {})
    return states.setdefault((namespace, name), controller.State())


# The children the operator watches (drift repair, the pod cache), and the selector
# that keeps their LIST+WATCH to its own objects.
CHILD_RESOURCES = (("v1", "pods"), ("apps/v1", "deployments"), ("v1", "services"),
                   ("policy/v1", "poddisruptionbudgets"))
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={resources.MANAGER}"


def watch_only_managed(settings: kopf.OperatorSettings) -> None:
    """Filter the children's watch-streams on the API server. Why: kopf applies a
    handler's `labels=` on the client, after it has streamed (and remembered) every
    Pod, Deployment, Service and PDB in its namespaces, which on a shared cluster means
    API-server load and an operator OOM; the selector here goes into the LIST+WATCH."""
    for group_version, plural in CHILD_RESOURCES:
        settings.watching.label_selectors[group_version, plural] = MANAGED_SELECTOR


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
                  **_: Any) -> None:
    settings.persistence.finalizer = f"{PREFIX}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration")
    # Our own Events carry the story (scales, invalid specs); kopf's per-handler
    # "succeeded" chatter would drown them.
    settings.posting.level = logging.WARNING
    # kopf retries failed API calls, 403s included, for 54 s by default. On uninstall
    # the RBAC can be gone before the pod gets SIGTERM, and kopf's exit (taking itself
    # out of the peering) would then outlive the pod's 30 s grace and be SIGKILLed.
    # These backoffs add up to 20 s: still enough to ride out an API server restart.
    settings.networking.error_backoffs = (1, 1, 2, 3, 5, 8)
    watch_only_managed(settings)
    if memo.get("pf_no_scanning"):
        settings.scanning.disabled = True
    if "kube" not in memo:
        memo["kube"] = KubeClient.from_environment()
    # Shared by every per-resource memo (they are shallow copies of this one).
    memo["pf_exiting"] = asyncio.Event()
    memo.setdefault("pf_states", {})
    if "pf_settings" not in memo:
        memo["pf_settings"] = controller.Settings(default_image=os.environ.get(IMAGE_ENV, DEFAULT_IMAGE))
    memo["pf_settings"].session = metrics.new_session()
    refs = memo.get("pf_gateway_refs") or []
    if refs and memo["pf_settings"].gateway is None:
        # The gateway's held requests wake models at zero (and add to the load).
        memo["pf_settings"].gateway = gateway.GatewayScraper(memo["kube"], refs)
        logger.info(f"Reading the gateway's counts from {memo['pf_settings'].gateway.describe()}.")
    peering = memo.get("pf_peering")
    if peering and not settings.peering.standalone:
        settings.peering.name = peering["name"]
        settings.peering.lifetime = peering.get("lifetime", settings.peering.lifetime)
        kube = memo["kube"]
        targets = await peering_targets(kube, peering, logger)
        if await ensure_peering(kube, peering, logger, targets):
            await join_peering(kube, peering, settings, logger, targets)
            if namespace_patterns(peering["namespaces"]):
                memo["pf_peering_follower"] = asyncio.create_task(
                    follow_peering_namespaces(kube, peering, settings, logger, set(targets)),
                    name="pagefleet peering objects of new namespaces")


# kopf's namespace patterns: globs, negations ('!team-x'), comma-separated lists.
PATTERN_CHARS = frozenset("*?[!,")
# How often the operator looks for new namespaces that its patterns match.
PEERING_SCAN_S = 5.0


def namespace_patterns(namespaces: list[str]) -> list[str]:
    return [ns for ns in namespaces if PATTERN_CHARS & set(ns)]


def _matches(namespace: str, pattern: str) -> bool:
    try:  # kopf's own matching, so both agree on which namespaces are served
        from kopf._cogs.structs.references import match_namespace
    except ImportError:  # pragma: no cover - kopf moved it
        import fnmatch

        return fnmatch.fnmatchcase(namespace, pattern)
    return bool(match_namespace(namespace, pattern))


async def peering_targets(kube: KubeClient, peering: dict[str, Any],
                          logger: logging.Logger) -> list[tuple[str, str | None]]:
    """The peering objects kopf watches: the ClusterKopfPeering when the operator
    serves the whole cluster, otherwise a KopfPeering in every namespace it serves, the
    ones its patterns match included (kopf peers per served namespace, and with
    mandatory peering it stays paused, all of it, until the object of each one exists)."""
    namespaces = peering["namespaces"]
    if not namespaces:
        return [("clusterkopfpeerings", None)]
    served = [ns for ns in namespaces if ns not in namespace_patterns(namespaces)]
    patterns = namespace_patterns(namespaces)
    if patterns:
        try:
            existing = await kube.list(path_for("v1", "namespaces", None))
        except (KubeError, aiohttp.ClientError, OSError) as e:
            logger.warning(f"Cannot list namespaces for the peering objects of {patterns} ({e}).")
            existing = []
        for obj in existing:
            name = obj["metadata"]["name"]
            if name not in served and any(_matches(name, p) for p in patterns):
                served.append(name)
    return [("kopfpeerings", ns) for ns in served]


async def ensure_peering(kube: KubeClient, peering: dict[str, Any], logger: logging.Logger,
                         targets: list[tuple[str, str | None]]) -> bool:
    """kopf only peers through an existing peering object; create it if missing so a
    second operator replica pauses instead of double-acting. False when the peering
    CRDs are missing (the operator then runs alone, with a warning)."""
    name = peering["name"]
    for plural, ns in targets:
        path = path_for("kopf.dev/v1", plural, ns, name)
        try:
            if await kube.get(path) is None:
                kind = "ClusterKopfPeering" if ns is None else "KopfPeering"
                meta = {"name": name, **({"namespace": ns} if ns else {})}
                try:
                    await kube.create(path.rsplit("/", 1)[0], {"apiVersion": "kopf.dev/v1", "kind": kind,
                                                               "metadata": meta})
                    logger.info(f"Created {kind} {name!r}{f' in {ns!r}' if ns else ''}.")
                except KubeError as e:
                    if e.status != 409:  # another replica created it first
                        raise
        except (KubeError, aiohttp.ClientError, OSError) as e:
            logger.warning(f"Cannot ensure the peering object {name!r} ({e}); install the kopf "
                           "peering CRDs (`pagefleet crd --peering`) for more than one replica.")
            return False
    return True


def auto_priority() -> int:
    """Earlier registration, higher priority: the replica that registered first keeps
    acting and a newcomer (a second replica, a rollout's surge pod) waits for it. Each
    replica's value is distinct (microseconds), so kopf never sees a tie, which pauses
    every operator. Negative, so an explicit --priority (kopf's default 0, e.g. a
    developer's `kopf run` on a laptop) outranks the in-cluster replicas."""
    return -(time.time_ns() // 1000)


async def join_peering(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                       logger: logging.Logger, targets: list[tuple[str, str | None]]) -> None:
    """Make peering mandatory (start paused until the peers are seen, so a newcomer
    never acts before it knows about the replica already acting) and write this
    replica's presence before any watch starts."""
    settings.peering.mandatory = True
    if peering.get("priority") is None:
        settings.peering.priority = auto_priority()
    await register(kube, peering, settings, logger, targets)
    logger.info(f"Peering as {peering.get('identity')!r} with priority {settings.peering.priority}.")


async def register(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                   logger: logging.Logger, targets: list[tuple[str, str | None]]) -> None:
    """This replica's presence in the peering objects (kopf's keep-alive renews it)."""
    identity = peering.get("identity")
    if not identity:
        return
    record = {"priority": settings.peering.priority, "lifetime": settings.peering.lifetime,
              "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}
    for plural, ns in targets:
        try:
            await kube.patch(path_for("kopf.dev/v1", plural, ns, peering["name"]),
                             {"status": {identity: record}})
        except (KubeError, aiohttp.ClientError, OSError) as e:
            logger.warning(f"Cannot register in the peering object ({e}); kopf will retry.")


async def follow_peering_namespaces(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                                    logger: logging.Logger, done: set[tuple[str, str | None]]) -> None:
    """With namespace patterns, namespaces that appear later need their KopfPeering
    too: kopf starts serving (and, peering being mandatory, pauses the whole operator
    for) a new matching namespace until the object exists there. Not a kopf handler:
    those pause with the operator, and this is what lifts the pause."""
    while True:
        await asyncio.sleep(PEERING_SCAN_S)
        try:
            targets = [t for t in await peering_targets(kube, peering, logger) if t not in done]
            if targets and await ensure_peering(kube, peering, logger, targets):
                await register(kube, peering, settings, logger, targets)
                done.update(targets)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - keep following; the next round retries
            logger.warning(f"Peering objects of new namespaces: {e}")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "pf_exiting" in memo:
        memo["pf_exiting"].set()
    follower = memo.get("pf_peering_follower")
    if follower is not None:
        follower.cancel()
    settings = memo.get("pf_settings")
    if settings is not None and settings.session is not None:
        await settings.session.close()
        settings.session = None
    if "kube" in memo:
        await memo["kube"].close()


# ---------------------------------------------------------------- watch caches

@kopf.index(**RESOURCE)
def pf_mdeps(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """ModelDeployments by (namespace, child name): the owner of a child or a pod."""
    return {(namespace, names.child_name(name)): copy.deepcopy(dict(body))}


@kopf.index("v1", "pods", **MANAGED)
def pf_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    """Server pods by (namespace, child name): what the autoscaler scrapes and the
    OOM remediation reads, kept current by a watch (no LIST per round)."""
    owner = labels.get(resources.LABEL_MDEP)
    return {(namespace, owner): copy.deepcopy(dict(body))} if owner else None


def _owner(index: kopf.Index, namespace: str, labels: kopf.Labels) -> dict[str, Any] | None:
    store = index.get((namespace, labels.get(resources.LABEL_MDEP)), None)
    return next(iter(store), None) if store else None


# ---------------------------------------------------------------- ModelDeployments

@kopf.on.resume(**RESOURCE)
@kopf.on.create(**RESOURCE)
@kopf.on.update(**RESOURCE)
async def reconcile(body: kopf.Body, memo: kopf.Memo, namespace: str, name: str, **_: Any) -> None:
    if body.metadata.get("deletionTimestamp"):
        return
    try:
        # fresh: the event's copy may predate the last status write (the evaluation's
        # scrape and OOM fields), and a status built on it would write them back.
        await controller.reconcile(memo["kube"], body, _state(memo, namespace, name), memo["pf_settings"],
                                   fresh=True)
    except (KubeError, controller.Conflict) as e:
        # Reported as Degraded already. Conflicts, throttling and server errors heal;
        # refusals need a change somewhere, so they are retried less often.
        raise kopf.TemporaryError(str(e), delay=60 if controller._stalling(e) else 10) from e


# optional: owner references already make the garbage collector delete the children,
# so this handler is no reason for a finalizer of its own. (The autoscaler daemon is:
# kopf 1.45 puts a finalizer on every object a daemon runs for, to stop it first.)
@kopf.on.delete(**RESOURCE, optional=True)
async def delete(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    state = _state(memo, namespace, name)
    async with state.lock:
        state.deleting = True
        try:
            deleted = await controller.cleanup(memo["kube"], namespace, name, memo["pf_settings"])
        except KubeError as e:
            raise kopf.TemporaryError(str(e), delay=5) from e
    memo["pf_states"].pop((namespace, name), None)
    logger.info(f"Deleted {', '.join(deleted) or 'nothing (already gone)'}.")


@kopf.daemon(**RESOURCE, cancellation_timeout=10)
async def autoscaler(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, namespace: str,
                     name: str, pf_pods: kopf.Index, **_: Any) -> None:
    state = _state(memo, namespace, name)
    exiting: asyncio.Event = memo["pf_exiting"]
    loop = asyncio.get_running_loop()
    key = (namespace, names.child_name(name))
    while not (stopped or state.deleting or exiting.is_set()):
        if body.metadata.get("deletionTimestamp"):
            break
        pods = list(pf_pods.get(key, []))
        delay = await controller.safe_evaluate(memo["kube"], body, state, memo["pf_settings"], pods)
        # Sleep on kopf's stop flag (deletion, operator exit), in short steps so a
        # daemon that kopf spawned late during shutdown also notices the exit.
        deadline = loop.time() + delay
        while not (stopped or exiting.is_set()) and (left := deadline - loop.time()) > 0:
            await stopped.wait(min(left, 0.5))


# ---------------------------------------------------------------- children

@kopf.on.event("apps/v1", "deployments", **MANAGED)
@kopf.on.event("v1", "services", **MANAGED)
@kopf.on.event("policy/v1", "poddisruptionbudgets", **MANAGED)
async def child_changed(event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo,
                        pf_mdeps: kopf.Index, **_: Any) -> None:
    if event.get("type") not in ("MODIFIED", "DELETED"):
        return  # ADDED and the initial listing: nothing changed behind the operator's back
    owner = _owner(pf_mdeps, namespace, labels)
    if owner is None:
        return  # its ModelDeployment is gone (garbage collection follows)
    meta = owner["metadata"]
    state = _state(memo, meta["namespace"], meta["name"])
    try:
        await controller.repair(memo["kube"], owner, state, memo["pf_settings"], event["object"],
                                deleted=event.get("type") == "DELETED")
    except (KubeError, controller.Conflict, aiohttp.ClientError) as e:
        log.warning("%s/%s: repair failed: %s", meta["namespace"], meta["name"], e)
