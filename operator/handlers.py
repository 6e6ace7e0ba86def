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
        warnings = Warnings(logger)
        targets = await peering_targets(kube, peering, warnings)
        failed = await ensure_peering(kube, peering, warnings, targets)
        if failed is not None:
            # Peering stays mandatory even where a namespace refused its object (one
            # being deleted, a listed one that does not exist yet): the follower retries.
            ready = [t for t in targets if t not in failed]
            await join_peering(kube, peering, settings, logger, ready)
            # The objects known to exist: the follower adds those of new namespaces, the
            # healer recreates any of them deleted while the operator runs.
            done = set(ready)
            if peering["namespaces"]:
                memo["pf_peering_follower"] = asyncio.create_task(
                    follow_peering_namespaces(kube, peering, settings, logger, done, warnings),
                    name="pagefleet peering objects of new namespaces")
            memo["pf_peering_healer"] = asyncio.create_task(
                keep_peering(kube, peering, settings, done, warnings),
                name="pagefleet peering objects deleted while running")


# kopf's namespace patterns: globs, negations ('!team-x'), comma-separated lists.
PATTERN_CHARS = frozenset("*?[!,")
# How often the follower re-lists the namespaces (a watch tells it of changes between).
PEERING_SCAN_S = 300.0
# How often it retries a namespace that refused its peering object (and a failed
# namespace LIST or watch; one that is forbidden: PEERING_FORBIDDEN_S).
PEERING_RETRY_S = 10.0
PEERING_FORBIDDEN_S = 60.0
# Where kopf keeps the peering objects.
PEERING_API = "kopf.dev/v1"
NAMESPACES = "/api/v1/namespaces"

Target = tuple[str, str | None]


class Warnings:
    """A warning per subject, logged again only when its text changes (no log line
    every round for a condition that lasts, like a namespace listing that is refused)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.last: dict[Any, str] = {}

    def warn(self, key: Any, message: str) -> None:
        if self.last.get(key) != message:
            self.last[key] = message
            self.logger.warning(message)

    def clear(self, key: Any, message: str | None = None) -> None:
        if self.last.pop(key, None) is not None and message:
            self.logger.info(message)


def namespace_patterns(namespaces: list[str]) -> list[str]:
    return [ns for ns in namespaces if PATTERN_CHARS & set(ns)]


def _matches(namespace: str, pattern: str) -> bool:
    try:  # kopf's own matching, so both agree on which namespaces are served
        from kopf._cogs.structs.references import match_namespace
    except ImportError:  # pragma: no cover - kopf moved it
        import fnmatch

        return fnmatch.fnmatchcase(namespace, pattern)
    return bool(match_namespace(namespace, pattern))


def _active(namespace: dict[str, Any]) -> bool:
    """Not being deleted: the API refuses new objects in a Terminating namespace, and
    kopf serves no namespace that is on its way out."""
    return not ((namespace.get("metadata") or {}).get("deletionTimestamp")
                or (namespace.get("status") or {}).get("phase") == "Terminating")


def served_targets(peering: dict[str, Any], existing: list[dict[str, Any]] | None) -> list[Target]:
    """The peering objects kopf watches, from the namespaces that exist (None: not
    known, e.g. listing them is not allowed; kopf then serves the exact names)."""
    namespaces = peering["namespaces"]
    if not namespaces:
        return [("clusterkopfpeerings", None)]
    patterns = namespace_patterns(namespaces)
    exact = [ns for ns in namespaces if ns not in patterns]
    if not patterns or existing is None:
        # Exact names alone: kopf serves them whether they exist or not (it does not
        # look at namespaces at all).
        return [("kopfpeerings", ns) for ns in exact]
    # With patterns kopf serves what exists and matches, the exact names included.
    served = [obj["metadata"]["name"] for obj in existing
              if _active(obj) and any(_matches(obj["metadata"]["name"], p) for p in namespaces)]
    return [("kopfpeerings", ns) for ns in sorted(set(served))]


def _cannot_list(peering: dict[str, Any], error: BaseException) -> str:
    return (f"Cannot list namespaces for the peering objects of {peering['namespaces']} ({error}); "
            "peering in the exact names only (as kopf serves then) until it can.")


async def list_namespaces(kube: KubeClient) -> tuple[list[dict[str, Any]], str | None]:
    """Every namespace (page by page) and the list's resourceVersion, to watch from."""
    items: list[dict[str, Any]] = []
    params: dict[str, str] = {"limit": "500"}
    while True:
        page = await kube.request("GET", NAMESPACES, params=params)
        items += page.get("items") or []
        meta = page.get("metadata") or {}
        if not meta.get("continue"):
            return items, meta.get("resourceVersion")
        params["continue"] = meta["continue"]


async def peering_targets(kube: KubeClient, peering: dict[str, Any],
                          warnings: Warnings) -> list[Target]:
    """The peering objects kopf watches: the ClusterKopfPeering when the operator
    serves the whole cluster, otherwise a KopfPeering in every namespace it serves, the
    ones its patterns match included (kopf peers per served namespace, and with
    mandatory peering it stays paused, all of it, until the object of each one exists)."""
    existing = None
    if namespace_patterns(peering["namespaces"]):
        try:
            existing, _ = await list_namespaces(kube)
            warnings.clear("list")
        except (KubeError, aiohttp.ClientError, OSError) as e:
            warnings.warn("list", _cannot_list(peering, e))
    return served_targets(peering, existing)


async def peering_crds_missing(kube: KubeClient, plural: str) -> bool:
    """Whether the API server lacks the peering CRD (its discovery does not list it),
    as opposed to one namespace refusing the object (a 404 for a namespace that does
    not exist, a 403 for one being deleted)."""
    try:
        doc = await kube.get(f"/apis/{PEERING_API}")
    except (KubeError, aiohttp.ClientError, OSError):
        return False  # not known: treat as a per-namespace failure, retried
    return doc is None or plural not in {r.get("name") for r in doc.get("resources") or []}


async def ensure_peering(kube: KubeClient, peering: dict[str, Any], warnings: Warnings,
                         targets: list[Target], records: dict[str, Any] | None = None) -> list[Target] | None:
    """kopf only peers through an existing peering object; create it if missing so a
    second operator replica pauses instead of double-acting. Returns the targets where
    that failed (each warned about by name; the follower retries them), or None when
    the peering CRDs are missing (the operator then runs alone, with a warning).

    `records`: the healer's recreation of an object deleted while the operator ran. It
    is created holding the peers' records (in one write, so no replica ever sees it
    empty and resumes next to the leader), and that is logged as a warning."""
    name = peering["name"]
    failed: list[Target] = []
    for target in targets:
        plural, ns = target
        path = path_for(PEERING_API, plural, ns, name)
        kind = "ClusterKopfPeering" if ns is None else "KopfPeering"
        where = f" in {ns!r}" if ns else ""
        try:
            if await kube.get(path) is None:
                meta = {"name": name, **({"namespace": ns} if ns else {})}
                body = {"apiVersion": PEERING_API, "kind": kind, "metadata": meta}
                try:
                    if records is None:
                        await kube.create(path.rsplit("/", 1)[0], body)
                        warnings.logger.info(f"Created {kind} {name!r}{where}.")
                    else:
                        await kube.create(path.rsplit("/", 1)[0], {**body, "status": records})
                        warnings.logger.warning(
                            f"Recreated the {kind} {name!r}{where}: it was deleted while the operator ran. "
                            f"Peers carried over (as this replica last saw them): {', '.join(sorted(records))}.")
                except KubeError as e:
                    if e.status != 409:  # another replica created it first
                        raise
            warnings.clear(target, f"{kind} {name!r}{where} is in place.")
        except (KubeError, aiohttp.ClientError, OSError) as e:
            if isinstance(e, KubeError) and e.status == 404 and await peering_crds_missing(kube, plural):
                warnings.warn("crds", f"Cannot ensure the peering object {name!r} ({e}); install the kopf "
                                      "peering CRDs (`pagefleet crd --peering`) for more than one replica.")
                return None
            warnings.warn(target, f"Cannot create the {kind} {name!r}{where} ({e}); kopf keeps the operator "
                                  f"paused while a namespace it serves lacks it; retrying.")
            failed.append(target)
    return failed


def auto_priority() -> int:
    """Earlier registration, higher priority: the replica that registered first keeps
    acting and a newcomer (a second replica, a rollout's surge pod) waits for it. Each
    replica's value is distinct (microseconds), so kopf never sees a tie, which pauses
    every operator. Negative, so an explicit --priority (kopf's default 0, e.g. a
    developer's `kopf run` on a laptop) outranks the in-cluster replicas."""
    return -(time.time_ns() // 1000)


async def join_peering(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                       logger: logging.Logger, targets: list[Target]) -> None:
    """Make peering mandatory (start paused until the peers are seen, so a newcomer
    never acts before it knows about the replica already acting) and write this
    replica's presence before any watch starts."""
    settings.peering.mandatory = True
    if peering.get("priority") is None:
        settings.peering.priority = auto_priority()
    await register(kube, peering, settings, logger, targets)
    logger.info(f"Peering as {peering.get('identity')!r} with priority {settings.peering.priority}.")


async def register(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                   logger: logging.Logger, targets: list[Target]) -> None:
    """This replica's presence in the peering objects (kopf's keep-alive renews it)."""
    identity = peering.get("identity")
    if not identity:
        return
    record = own_record(settings)
    for plural, ns in targets:
        try:
            await kube.patch(path_for(PEERING_API, plural, ns, peering["name"]),
                             {"status": {identity: record}})
        except (KubeError, aiohttp.ClientError, OSError) as e:
            logger.warning(f"Cannot register in the peering object{f' of {ns!r}' if ns else ''} ({e}); "
                           "kopf will retry.")


def own_record(settings: kopf.OperatorSettings, now: datetime.datetime | None = None) -> dict[str, Any]:
    """This replica's record in a peering object, as kopf's keep-alive writes it."""
    now = now or datetime.datetime.now(datetime.UTC)
    return {"priority": settings.peering.priority, "lifetime": settings.peering.lifetime,
            "lastseen": now.isoformat()}


def heal_period(lifetime: float) -> float:
    """How often the healer looks for a deleted peering object: half a peering lifetime,
    so one is back within about one of kopf's keep-alive periods (lifetime − 5..10 s)."""
    return max(1.0, lifetime / 2)


def revived_records(last: dict[str, Any] | None, identity: str | None,
                    settings: kopf.OperatorSettings) -> dict[str, Any]:
    """The records a recreated peering object starts with: the peers still alive in its
    last state this replica saw, renewed to now, and this replica's own.

    Renewed, because their last keep-alive went to the object before it was deleted
    and their next can be a whole keep-alive period away: a stale `lastseen` could
    expire the leader's record before that, and a standby would act next to it (the
    split brain peering exists to prevent). The cost: a peer that died just before the
    deletion is replaced up to one lifetime later than otherwise."""
    now = datetime.datetime.now(datetime.UTC)
    records: dict[str, Any] = {}
    for peer, record in (last or {}).items():
        try:
            seen = datetime.datetime.fromisoformat(record["lastseen"])
            alive = seen + datetime.timedelta(seconds=int(record["lifetime"])) > now
        except (KeyError, TypeError, ValueError):
            continue  # not a record kopf would honour either
        if alive:
            records[peer] = {**record, "lastseen": now.isoformat()}
    if identity:
        records[identity] = own_record(settings, now)
    return records


async def heal_peering(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                       targets: set[Target], warnings: Warnings, last: dict[Target, dict[str, Any]]) -> None:
    """One round of the healer: recreate each peering object in `targets` that is gone.

    Why: kopf only patches the object (its keep-alive treats a 404 as "not found", at
    debug level) and never creates it; once it is deleted (`kubectl delete -f` of the
    peering manifest, a cleanup script) the leader goes on acting but no standby ever
    takes over from it. `last` keeps each object's status as last seen, carried into
    the new one. A namespace that refuses the object (being deleted, gone) leaves
    `targets`: the follower gives it a new object if kopf still serves it."""
    for target in list(targets):
        plural, ns = target
        try:
            obj = await kube.get(path_for(PEERING_API, plural, ns, peering["name"]))
        except (KubeError, aiohttp.ClientError, OSError) as e:
            warnings.warn(("read", target), f"Cannot read the peering object {peering['name']!r}"
                                            f"{f' in {ns!r}' if ns else ''} ({e}); retrying.")
            continue
        warnings.clear(("read", target))
        if obj is not None:
            last[target] = obj.get("status") or {}
            continue
        records = revived_records(last.get(target), peering.get("identity"), settings)
        failed = await ensure_peering(kube, peering, warnings, [target], records)
        if failed is None:
            continue  # the CRDs are gone (warned about): nothing to recreate until they are back
        if failed:
            if ns is not None:
                targets.discard(target)
            continue
        # Created here or, a 409, by another replica (whose records may predate ours).
        await register(kube, peering, settings, warnings.logger, [target])


async def keep_peering(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                       targets: set[Target], warnings: Warnings) -> None:
    """Recreate the peering objects deleted while the operator runs (see heal_peering),
    every heal_period. Not a kopf timer: those pause with the operator, and a standby
    must heal too (the leader may be the one that is gone). Never raises: an
    unexpected failure is logged and the next round tries again."""
    last: dict[Target, dict[str, Any]] = {}
    while True:
        try:
            await heal_peering(kube, peering, settings, targets, warnings, last)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the operator must outlive its healer's bugs
            warnings.logger.exception("Checking the peering objects failed; retrying.")
        await asyncio.sleep(heal_period(settings.peering.lifetime))


def _retry_after(error: BaseException | None) -> float:
    """When to LIST the namespaces again after `error`: at once for a watch that is
    too old (410), rarely where it is forbidden, soon for the rest (the API away)."""
    status = getattr(error, "status", None)
    return 0.0 if status == 410 else PEERING_FORBIDDEN_S if status in (401, 403) else PEERING_RETRY_S


async def _watch_namespaces(kube: KubeClient, resource_version: str,
                            queue: asyncio.Queue[dict[str, Any] | BaseException | None]) -> None:
    """Feed the namespace watch's events to `queue`; None when it ends (watch again
    from the last version seen), the exception when it fails (LIST again)."""
    try:
        async for event in kube.watch(NAMESPACES, resource_version, timeout_s=int(PEERING_SCAN_S)):
            await queue.put(event)
        await queue.put(None)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - handed to the follower
        await queue.put(e)


async def follow_peering_namespaces(kube: KubeClient, peering: dict[str, Any], settings: kopf.OperatorSettings,
                                    logger: logging.Logger, done: set[Target],
                                    warnings: Warnings | None = None) -> None:
    """Keep a peering object in every namespace kopf serves: with mandatory peering kopf
    pauses the whole operator while one lacks it, e.g. a namespace a pattern matches
    that appears later, or one deleted and created again (kopf serves it anew, and its
    old object went with it), or a listed one that refused it at startup. Not a kopf
    handler: those pause with the operator, and this is what lifts the pause.

    `done`: the targets whose object is known to exist. With patterns the namespaces
    come from a LIST every PEERING_SCAN_S and a watch in between (kopf's own watch is
    not reachable from here); with exact names only, the operator may not read
    namespaces at all, and the names themselves are the targets."""
    warnings = warnings or Warnings(logger)
    patterns = bool(namespace_patterns(peering["namespaces"]))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()
    watcher: asyncio.Task[None] | None = None
    known: dict[str, dict[str, Any]] = {}  # namespace name -> object (patterns only)
    listed = next_list = 0.0
    version: str | None = None
    try:
        while True:
            if loop.time() >= next_list:
                if watcher is not None:
                    watcher.cancel()
                    watcher = None
                queue = asyncio.Queue()
                version = None
                failure: BaseException | None = None
                if patterns:
                    try:
                        items, version = await list_namespaces(kube)
                        known = {i["metadata"]["name"]: i for i in items}
                        warnings.clear("list", "Listing namespaces works again.")
                    except (KubeError, aiohttp.ClientError, OSError) as e:
                        warnings.warn("list", _cannot_list(peering, e))
                        known, version = {}, None
                        failure = e
                    targets = served_targets(peering, list(known.values()) if version else None)
                else:
                    targets = served_targets(peering, None)
                    done.clear()  # exact names: check their objects again (a GET each)
                listed = loop.time()
                next_list = listed + (PEERING_SCAN_S if version or not patterns else _retry_after(failure))
                if version:
                    watcher = asyncio.create_task(_watch_namespaces(kube, version, queue),
                                                  name="pagefleet namespace watch")
            elif patterns and version:
                targets = served_targets(peering, list(known.values()))
            else:
                targets = served_targets(peering, None)
            # A namespace gone (or going) takes its object with it: when it is back,
            # kopf serves it anew and it needs a new one.
            done &= set(targets)
            missing = [t for t in targets if t not in done]
            failed: list[Target] = []
            if missing:
                got = await ensure_peering(kube, peering, warnings, missing)
                failed = missing if got is None else got
                ready = [t for t in missing if t not in failed]
                await register(kube, peering, settings, logger, ready)
                done.update(ready)
            # Until something changes: a namespace event, the retry of a failed one, the re-LIST.
            wait = max(0.0, next_list - loop.time())
            if failed:
                wait = min(wait, PEERING_RETRY_S)
            try:
                event = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                continue
            while True:  # this event and any that queued behind it
                if isinstance(event, BaseException):
                    warnings.warn("watch", f"The namespace watch failed ({event}); listing again.")
                    next_list = min(next_list, listed + _retry_after(event))
                    watcher = None
                elif event is None:  # the server ended the watch: go on from the last version
                    watcher = asyncio.create_task(_watch_namespaces(kube, version or "", queue),
                                                  name="pagefleet namespace watch")
                else:
                    warnings.clear("watch")
                    obj = event.get("object") or {}
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    name = (obj.get("metadata") or {}).get("name")
                    before = known.get(name) or {}
                    if event.get("type") == "DELETED":
                        known.pop(name, None)
                    elif event.get("type") in ("ADDED", "MODIFIED") and name:
                        known[name] = obj
                    # Gone, going, or a new namespace of the same name (its events can
                    # come in one batch): its object has to be made again.
                    if (event.get("type") == "DELETED" or not _active(obj)
                            or (before.get("metadata") or {}).get("uid") != (obj.get("metadata") or {}).get("uid")):
                        done.discard(("kopfpeerings", name))
                if queue.empty():
                    break
                event = queue.get_nowait()
    finally:
        if watcher is not None:
            watcher.cancel()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "pf_exiting" in memo:
        memo["pf_exiting"].set()
    for task in ("pf_peering_follower", "pf_peering_healer"):
        if memo.get(task) is not None:
            memo[task].cancel()
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
