"""Where the fleet comes from. Every source has the same two-call interface:

    spec = await source.first()     # the fleet at startup (errors stop the gateway)
    await source.watch(apply)       # forever: apply(FleetSpec) on every change

`StaticDiscovery` reads the YAML models file and re-reads it when its modification
time or size changes (edit the file to add, drain or reweight endpoints without a
restart); a file that stops parsing is logged and the last good fleet kept.
`kube.KubernetesDiscovery` watches ModelDeployments and their pods.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Protocol

from pagefleet.server.config import ConfigError
from pagefleet.server.gateway.fleet import FleetSpec, load_fleet_file

log = logging.getLogger("pagefleet.gateway")


class Discovery(Protocol):
    async def first(self) -> FleetSpec: ...

    async def watch(self, apply: Callable[[FleetSpec], None]) -> None: ...


class StaticDiscovery:
    def __init__(self, path: str, interval: float = 2.0) -> None:
        self.path = path
        self.interval = interval
        self._stamp: tuple[float, int] | None = None

    def _file_stamp(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime, st.st_size

    async def first(self) -> FleetSpec:
        self._stamp = self._file_stamp()
        return load_fleet_file(self.path)

    async def watch(self, apply: Callable[[FleetSpec], None]) -> None:
        while True:
            await asyncio.sleep(self.interval)
            stamp = self._file_stamp()
            if stamp is None or stamp == self._stamp:
                continue
            self._stamp = stamp
            try:
                spec = load_fleet_file(self.path)
            except ConfigError as e:
                log.error("models file changed but cannot be used (keeping the previous "
                          "fleet): %s", e)
                continue
            log.info("models file changed: %d model(s)", len(spec.models))
            apply(spec)
