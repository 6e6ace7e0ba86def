"""`pagefleet gateway`: build the discovery source and the Gateway, run uvicorn.

On SIGTERM uvicorn stops accepting connections and lets in-flight requests (streams
included) finish for up to `GRACEFUL_SHUTDOWN_S`; the gateway holds no state worth
saving (its prefix picture is rebuilt from traffic).
"""

from __future__ import annotations

import logging
import os
import sys

from pagefleet.server.api.serve import http_url, listen_or_explain
from pagefleet.server.config import ConfigError
from pagefleet.server.gateway.config import GatewayConfig

log = logging.getLogger("pagefleet.gateway")
GRACEFUL_SHUTDOWN_S = 30


def setup_logging() -> None:
    root = logging.getLogger("pagefleet")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                               "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("PAGEFLEET_LOG_LEVEL", "INFO").upper())
        root.propagate = False


def make_discovery(cfg: GatewayConfig):
    if cfg.discovery == "kubernetes":
        from pagefleet.server.gateway.kube import KubernetesDiscovery

        return KubernetesDiscovery(namespace=cfg.namespace)
    from pagefleet.server.gateway.discovery import StaticDiscovery

    return StaticDiscovery(cfg.models_file, cfg.reload_interval)


def make_gateway(cfg: GatewayConfig):
    """The Gateway for a validated config (raises ConfigError for bad key files)."""
    from pagefleet.server.gateway.admission import default_limit, load_api_keys
    from pagefleet.server.gateway.app import Gateway

    keys = None
    if cfg.api_keys_file:
        keys = load_api_keys(cfg.api_keys_file, default_limit(cfg.rate_limit,
                                                              cfg.rate_limit_burst))
    return Gateway(cfg, make_discovery(cfg), keys)


def _server_class():
    import signal

    import uvicorn

    class GatewayServer(uvicorn.Server):
        """uvicorn.Server that exits 0 after a graceful SIGTERM/SIGINT instead of
        re-raising the signal; a second Ctrl-C still forces the exit."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
                return
            if not self.should_exit:
                log.info("received %s: finishing in-flight requests (up to %ds)",
                         signal.Signals(sig).name, GRACEFUL_SHUTDOWN_S)
            self.should_exit = True

    return GatewayServer


def run_gateway(cfg: GatewayConfig) -> int:
    setup_logging()
    try:
        gateway = make_gateway(cfg)
        if cfg.discovery == "static":
            from pagefleet.server.gateway.fleet import load_fleet_file

            load_fleet_file(cfg.models_file)      # fail before binding the port
    except ConfigError as e:
        print(f"pagefleet gateway: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from pagefleet.server.gateway.app import build_app

    app = build_app(gateway)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.uvicorn_log_level,
                            lifespan="on", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            timeout_keep_alive=cfg.timeout_keep_alive,
                            # No proxy headers in uvicorn: the gateway reads
                            # X-Forwarded-For itself, for the rate limit only
                            # (admission.TrustedProxies). uvicorn's default trusts
                            # loopback, and its '*' takes the left-most entry, which the
                            # client writes, as any string.
                            proxy_headers=False, forwarded_allow_ips="")
    server = _server_class()(config)
    # Bind here, as `pagefleet serve` does, so the log names the port really taken
    # (--port 0 picks a free one) and a port in use is a one-line error.
    sock = listen_or_explain("gateway", cfg.host, cfg.port)
    if sock is None:
        return 1
    cfg.port = sock.getsockname()[1]
    if gateway.proxies.any_peer:
        log.warning("--forwarded-allow-ips '*': every peer may set X-Forwarded-For, so a "
                    "client that reaches the gateway directly (not through the proxy) "
                    "names its own address and picks its rate-limit bucket; name the "
                    "proxies' addresses or networks (CIDR) instead where you can")
    log.info("gateway starting on %s (%s discovery, %s routing)", http_url(cfg.host, cfg.port),
             cfg.discovery, cfg.routing)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
