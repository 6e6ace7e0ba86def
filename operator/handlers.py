"""kopf handlers: thin glue from kopf's triggers to `controller`.

- create / update / resume -> controller.reconcile (children match the spec)
- a daemon per ModelDeployment -> controller.evaluate every intervalSeconds
  (autoscaling and status), sleeping on kopf's stop flag so deletion is prompt
- delete -> controller.cleanup (owner references do it on a real cluster too)

Usable both through `pagefleet operator` and as `kopf run -m pagefleet.operator.handlers`.
Handler progress and the diff base are kept in annotations under
operator.pagefleet.dev, so `.status` holds only what DESIGN.md lists.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import aiohttp
import kopf

from pagefleet.operator import controller, crd
from pagefleet.operator.kube import KubeClient, KubeError, path_for
from pagefleet.operator.spec import DEFAULT_IMAGE

RESOURCE: dict[str, Any] = {"group": crd.GROUP, "version": crd.VERSION, "plural": crd.PLURAL}
PREFIX = "operator.pagefleet.dev"
IMAGE_ENV = "PAGEFLEET_SERVER_IMAGE"


def _state(memo: kopf.Memo) -> controller.State:
    """Per-resource in-memory state (kopf gives each object its own memo)."""
    if "pf_state" not in memo:
        memo["pf_state"] = controller.State()
    return memo["pf_state"]


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
    if memo.get("pf_no_scanning"):
        settings.scanning.disabled = True
    if "kube" not in memo:
        memo["kube"] = KubeClient.from_environment()
    # Shared by every per-resource memo (they are shallow copies of this one).
    memo["pf_exiting"] = asyncio.Event()
    if "pf_settings" not in memo:
        memo["pf_settings"] = controller.Settings(default_image=os.environ.get(IMAGE_ENV, DEFAULT_IMAGE))
    peering = memo.get("pf_peering")
    if peering and not settings.peering.standalone:
        settings.peering.name = peering["name"]
        await ensure_peering(memo["kube"], peering, logger)


async def ensure_peering(kube: KubeClient, peering: dict[str, Any], logger: logging.Logger) -> None:
    """kopf only peers through an existing peering object; create it if missing so a
    second operator replica pauses instead of double-acting."""
    name = peering["name"]
    targets = ([("clusterkopfpeerings", None)] if not peering["namespaces"]
               else [("kopfpeerings", ns) for ns in peering["namespaces"]])
    for plural, ns in targets:
        path = path_for("kopf.dev/v1", plural, ns, name)
        try:
            if await kube.get(path) is None:
                kind = "ClusterKopfPeering" if ns is None else "KopfPeering"
                meta = {"name": name, **({"namespace": ns} if ns else {})}
                await kube.create(path.rsplit("/", 1)[0], {"apiVersion": "kopf.dev/v1", "kind": kind,
                                                           "metadata": meta})
                logger.info(f"Created {kind} {name!r}.")
        except (KubeError, aiohttp.ClientError, OSError) as e:
            logger.warning(f"Cannot ensure the peering object {name!r} ({e}); install the kopf "
                           "peering CRDs (`pagefleet crd --peering`) for more than one replica.")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "pf_exiting" in memo:
        memo["pf_exiting"].set()
    if "kube" in memo:
        await memo["kube"].close()


@kopf.on.resume(**RESOURCE)
@kopf.on.create(**RESOURCE)
@kopf.on.update(**RESOURCE)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if body.metadata.get("deletionTimestamp"):
        return
    try:
        await controller.reconcile(memo["kube"], body, _state(memo), memo["pf_settings"])
    except KubeError as e:
        # Conflicts, throttling and server errors heal; retry with a delay.
        raise kopf.TemporaryError(str(e), delay=10) from e


@kopf.on.delete(**RESOURCE)
async def delete(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    state = _state(memo)
    async with state.lock:
        state.deleting = True
        try:
            deleted = await controller.cleanup(memo["kube"], namespace, name)
        except KubeError as e:
            raise kopf.TemporaryError(str(e), delay=5) from e
    logger.info(f"Deleted {', '.join(deleted) or 'nothing (already gone)'}.")


@kopf.daemon(**RESOURCE, cancellation_timeout=10)
async def autoscaler(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    state = _state(memo)
    exiting: asyncio.Event = memo["pf_exiting"]
    loop = asyncio.get_running_loop()
    while not (stopped or state.deleting or exiting.is_set()):
        if body.metadata.get("deletionTimestamp"):
            break
        delay = await controller.safe_evaluate(memo["kube"], body, state, memo["pf_settings"])
        # Sleep on kopf's stop flag (deletion, operator exit), in short steps so a
        # daemon that kopf spawned late during shutdown also notices the exit.
        deadline = loop.time() + delay
        while not (stopped or exiting.is_set()) and (left := deadline - loop.time()) > 0:
            await stopped.wait(min(left, 0.5))
