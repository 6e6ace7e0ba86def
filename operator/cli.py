"""`pagefleet operator` and `pagefleet crd`.

`pagefleet operator` runs kopf in-process with our handlers: all namespaces unless
`--namespace` is given (repeatable), a liveness endpoint for the Deployment's probe,
and kopf peering (on by default) so that extra operator replicas stand by instead of
acting twice: each replica gets a distinct priority (earliest registration highest),
and a standby takes over within --peering-lifetime of the leader's death.
`pagefleet crd` prints the CRD YAML that charts/ and manifests/ hold.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
DEFAULT_PEERING = "pagefleet"
DEFAULT_LIFETIME = 60


def _priority(text: str) -> int | None:
    """--priority: an integer, or 'auto' (None)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def identity() -> str:
    """This replica's peering identity: the pod name (POD_NAME, set by the chart from
    the downward API) or the host name, plus the process id, so two processes on one
    machine never share it."""
    import socket

    return f"{os.environ.get('POD_NAME') or socket.gethostname()}/{os.getpid()}"


def crd_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet crd",
                                description="Print the ModelDeployment CustomResourceDefinition (YAML).")
    p.add_argument("--peering", action="store_true",
                   help="Print kopf's peering CRDs instead (needed for more than one operator replica).")
    return p


def operator_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet operator",
                                description="Run the ModelDeployment operator (kopf).")
    p.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                   help="Watch this namespace (repeatable; globs like 'team-*' work). "
                        "Default: all namespaces.")
    p.add_argument("--all-namespaces", "-A", action="store_true",
                   help="Watch all namespaces (the default when no --namespace is given).")
    p.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                   help=f"Liveness endpoint to serve (default {DEFAULT_LIVENESS}); '' disables it.")
    p.add_argument("--standalone", action="store_true",
                   help="No peering: act even if other operators run (single replica, tests).")
    p.add_argument("--peering", default=DEFAULT_PEERING, metavar="NAME",
                   help=f"kopf peering object shared by the operator replicas (default {DEFAULT_PEERING}).")
    p.add_argument("--priority", type=_priority, default=None, metavar="N|auto",
                   help="Peering priority: the highest-priority replica acts, the others pause. "
                        "Default auto: the replica that registered first acts (distinct per "
                        "replica; equal priorities would pause every replica).")
    p.add_argument("--peering-lifetime", type=int, default=DEFAULT_LIFETIME, metavar="S",
                   help=f"Seconds a replica's peering record lives without a keep-alive (default "
                        f"{DEFAULT_LIFETIME}): a killed leader is replaced within this time.")
    p.add_argument("--server-image", default=None, metavar="IMAGE",
                   help="Default server image for ModelDeployments without spec.image "
                        "(default: $PAGEFLEET_SERVER_IMAGE, else the built-in one).")
    p.add_argument("--gateway-service", action="append", default=[], metavar="NS/NAME[:PORT]",
                   help="The pagefleet gateway's Service (repeatable): every ready replica behind it "
                        "is scraped for the requests it holds per model and pool, which scale "
                        "ModelDeployments with minReplicas 0 up from zero (and count as load). "
                        "PORT: the Service port's name or number (default http). Needs list on "
                        "endpointslices in NS.")
    p.add_argument("--verbose", "-v", action="store_true", help="Log more.")
    return p


def run_operator(argv: list[str]) -> int:
    args = operator_parser().parse_args(argv)
    if args.all_namespaces and args.namespace:
        print("pagefleet operator: error: --all-namespaces and --namespace exclude each other",
              file=sys.stderr)
        return 2
    from pagefleet.operator import gateway

    try:
        gateway_refs = [gateway.parse_ref(v) for v in args.gateway_service]
    except gateway.GatewayRefError as e:
        print(f"pagefleet operator: error: --gateway-service: {e}", file=sys.stderr)
        return 2
    import kopf

    from pagefleet.operator import controller, handlers  # noqa: F401  (registers the handlers)
    from pagefleet.operator.spec import DEFAULT_IMAGE

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    if not args.verbose:  # one access line per liveness probe is noise
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        # ... and so is "Handler 'child_changed' succeeded" on every child status update:
        # the operator's own log lines (pagefleet.operator) tell what it did.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    namespaces = list(args.namespace)
    memo = kopf.Memo()
    memo["pf_gateway_refs"] = gateway_refs
    me = identity()
    memo["pf_settings"] = controller.Settings(
        default_image=args.server_image or os.environ.get(handlers.IMAGE_ENV, DEFAULT_IMAGE),
        instance=me)
    if not args.standalone:
        # Not kopf.run(peering_name=...): that makes peering mandatory, and kopf then
        # pauses for good when the peering CRDs are not installed. The startup handler
        # creates the peering object, then makes peering mandatory and registers.
        memo["pf_peering"] = {"name": args.peering, "identity": me, "priority": args.priority,
                              "lifetime": args.peering_lifetime,
                              "namespaces": namespaces}
    # Exact namespace names need no cluster-wide listing of namespaces or CRDs, so a
    # namespace-scoped RBAC role is enough (kopf would otherwise retry 403s for a minute).
    memo["pf_no_scanning"] = bool(namespaces) and not handlers.namespace_patterns(namespaces)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone,
        priority=args.priority,
        identity=me,
        liveness_endpoint=args.liveness or None,
        memo=memo,
    )
    return 0


def main(cmd: str, argv: list[str]) -> int:
    """Entry point from `pagefleet.server.cli` for `operator` and `crd`."""
    if cmd == "crd":
        args = crd_parser().parse_args(argv)
        from pagefleet.operator import crd

        sys.stdout.write(crd.peering_crds_yaml() if args.peering else crd.crd_yaml())
        return 0
    if cmd == "operator":
        return run_operator(argv)
    print(f"pagefleet: unknown operator command {cmd!r}", file=sys.stderr)
    return 2
