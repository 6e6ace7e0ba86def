"""Admission: who may wait in the gateway's queue, per-key rate limits, API keys (pure).

Priority uses vLLM's meaning of the request's `priority` field (the servers schedule by
the same field): a lower value is more urgent, 0 is the default. When a model's queue
is full, the least urgent waiter is refused first: a newcomer more urgent than the
worst waiter takes its place (the waiter gets the 429), otherwise the newcomer gets
it. Requests at or below `critical_priority` are never refused for a full queue: they
shed a less urgent waiter, or wait beyond the cap when everyone waiting is critical.
Every waiter, critical ones too, still obeys the queue-time limit (503); since the
queue dispatches the most urgent first, critical requests only reach it when the model
has no capacity at all.

Rate limits are token buckets per API key (requests per second and a burst), with
per-key overrides from the API keys file; requests without a key get one bucket per
client network (by default an IPv4 address, or an IPv6 /64: `ClientNetworks`), taken
from the TCP peer or, behind a trusted proxy, from X-Forwarded-For by the
right-most-untrusted rule (`TrustedProxies`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagefleet.server.config import ConfigError


# -- queue admission -----------------------------------------------------------------------
@dataclass(frozen=True)
class Queued:
    priority: int
    seq: int                         # arrival order


@dataclass(frozen=True)
class Admission:
    kind: str                        # "enqueue" | "shed" | "refuse"
    victim: Queued | None = None     # for "shed": the waiter refused in the newcomer's place


def is_critical(priority: int, critical_priority: int | None) -> bool:
    return critical_priority is not None and priority <= critical_priority


def admit(queued: Sequence[Queued], priority: int, cap: int,
          critical_priority: int | None) -> Admission:
    """Decide on a newcomer of `priority` given the model's waiters (pure)."""
    if len(queued) < cap:
        return Admission("enqueue")
    victims = [q for q in queued if not is_critical(q.priority, critical_priority)]
    if victims:
        worst = max(victims, key=lambda q: (q.priority, q.seq))
        if worst.priority > priority:
            return Admission("shed", worst)
    if is_critical(priority, critical_priority):
        return Admission("enqueue")
    return Admission("refuse")


# -- rate limits ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RateLimit:
    rate: float                      # requests per second
    burst: float                     # bucket size


class TokenBucket:
    def __init__(self, limit: RateLimit, now: float) -> None:
        self.limit = limit
        self.tokens = limit.burst
        self.last = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 when allowed, else seconds until one is available."""
        self.tokens = min(self.limit.burst, self.tokens + (now - self.last) * self.limit.rate)
        self.last = max(now, self.last)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.limit.rate


class RateLimiter:
    """One bucket per key (at most `max_keys` remembered, least recently used dropped)."""

    def __init__(self, default: RateLimit | None, max_keys: int = 100_000) -> None:
        self.default = default
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def check(self, key_id: str, limit: RateLimit | None, now: float) -> float:
        """0.0 when the request may pass, else the seconds to wait (for Retry-After)."""
        limit = limit or self.default
        if limit is None:
            return 0.0
        b = self._buckets.get(key_id)
        if b is None or b.limit != limit:
            b = self._buckets[key_id] = TokenBucket(limit, now)
        self._buckets.move_to_end(key_id)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return b.take(now)


# -- client addresses ------------------------------------------------------------------------
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_FORWARDED_HOPS = 16      # X-Forwarded-For entries read, from the right


@dataclass(frozen=True)
class ClientNetworks:
    """How wide a client is, for the rate limit of requests without an API key
    (--rate-limit-ipv4-prefix / --rate-limit-ipv6-prefix): one bucket per IPv4 network
    of `ipv4` bits (32: per address) and per IPv6 network of `ipv6` bits (64 by default:
    a host is routinely given a whole /64, and one bucket per address would let it take
    as many as it likes)."""

    ipv4: int = 32
    ipv6: int = 64


def parse_ip(value: str) -> IPAddress | None:
    """A peer host or X-Forwarded-For entry as an address (bare, IPv4 `host:port`,
    `[IPv6]:port`; an IPv6 zone is dropped, an IPv4-mapped IPv6 address is its IPv4
    one); None when it is not an address."""
    v = value.strip()
    if len(v) > 64:                                   # no address is this long
        return None
    if v.startswith("["):
        end = v.find("]")
        rest = v[end + 1:]
        if end < 0 or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        v = v[1:end]
    elif v.count(":") == 1:
        v, _, port = v.partition(":")
        if not port.isdigit():
            return None
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.scope_id:
            return ipaddress.IPv6Address(int(ip))
    return ip


def address_key(ip: IPAddress, nets: ClientNetworks = ClientNetworks()) -> str:
    """The rate-limit bucket of an address: the network of `nets`' width it is in, an
    IPv4 address bare at /32 (short and canonical: no client-written text is kept)."""
    v4 = isinstance(ip, ipaddress.IPv4Address)
    if v4 and nets.ipv4 == 32:
        return f"addr:{ip}"
    return f"addr:{ipaddress.ip_network((ip, nets.ipv4 if v4 else nets.ipv6), strict=False)}"


class TrustedProxies:
    """--forwarded-allow-ips: the peers whose X-Forwarded-For names the client.

    The client is the right-most X-Forwarded-For entry that is not itself a trusted
    proxy (each proxy appends the address it got the request from, so everything left of
    the nearest untrusted entry was written by the client and is ignored). An entry that
    is not an IP address ends the walk and the TCP peer counts. `*` trusts every peer to
    be a proxy but no address in the header, so the right-most entry counts (what the
    nearest proxy appended); CIDRs given with it are skipped as further proxy hops."""

    def __init__(self, spec: str | None) -> None:
        self.any_peer = False
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            if item == "*":
                self.any_peer = True
                continue
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ConfigError(f"--forwarded-allow-ips: {item!r} is not an IP address "
                                  "or network (CIDR), nor '*'") from None

    @property
    def enabled(self) -> bool:
        return self.any_peer or bool(self.networks)

    def trusts(self, ip: IPAddress) -> bool:
        return any(ip in net for net in self.networks)

    def client(self, peer: str | None, forwarded_for: Sequence[str]) -> IPAddress | None:
        """The client's address from the TCP peer's host and the X-Forwarded-For header
        lines; None when not even the peer is an address."""
        peer_ip = parse_ip(peer) if peer else None
        if peer_ip is None or not forwarded_for or not (self.any_peer
                                                         or self.trusts(peer_ip)):
            return peer_ip
        entries = ",".join(forwarded_for).rsplit(",", MAX_FORWARDED_HOPS)[-MAX_FORWARDED_HOPS:]
        ip = peer_ip
        for entry in reversed(entries):
            ip = parse_ip(entry)
            if ip is None:
                return peer_ip              # not an address: no bucket of its own
            if not self.trusts(ip):
                return ip
        return ip     # every hop read is a trusted proxy: the left-most of them


def client_key(proxies: TrustedProxies, peer: str | None, forwarded_for: Sequence[str],
               nets: ClientNetworks = ClientNetworks()) -> str:
    """The bucket of a request without a verified API key."""
    ip = proxies.client(peer, forwarded_for)
    return address_key(ip, nets) if ip is not None else f"addr:{(peer or '')[:64]}"


def retry_after_header(wait: float) -> str:
    return str(max(1, math.ceil(wait)))


def default_limit(rate: float | None, burst: float | None) -> RateLimit | None:
    if rate is None:
        return None
    return RateLimit(rate, burst if burst is not None else max(rate, 1.0))


# -- API keys -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyInfo:
    name: str
    limit: RateLimit | None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class APIKeys:
    """Accepted keys by SHA-256 digest (lookups do not compare secrets byte by byte)."""

    def __init__(self, keys: dict[str, KeyInfo]) -> None:
        self._by_digest = keys

    def lookup(self, token: str | None) -> KeyInfo | None:
        if not token:
            return None
        return self._by_digest.get(digest(token))

    def __len__(self) -> int:
        return len(self._by_digest)


def parse_api_keys(data: Any, source: str, default: RateLimit | None) -> APIKeys:
    """`keys: [{key | key_sha256, name, requests_per_second, burst}]` -> APIKeys."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ConfigError(f"{source}: expected a mapping with a 'keys' list")
    out: dict[str, KeyInfo] = {}
    for i, item in enumerate(data["keys"]):
        path = f"{source}: keys[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{path}: must be a mapping")
        unknown = set(item) - {"key", "key_sha256", "name", "requests_per_second", "burst"}
        if unknown:
            raise ConfigError(f"{path}: unknown field(s) {', '.join(sorted(unknown))}")
        if ("key" in item) == ("key_sha256" in item):
            raise ConfigError(f"{path}: give exactly one of key or key_sha256")
        if "key" in item:
            if not isinstance(item["key"], str) or not item["key"]:
                raise ConfigError(f"{path}.key: must be a non-empty string")
            d = digest(item["key"])
        else:
            d = str(item["key_sha256"]).lower()
            if len(d) != 64 or any(ch not in "0123456789abcdef" for ch in d):
                raise ConfigError(f"{path}.key_sha256: must be 64 hex digits")
        rate, burst = item.get("requests_per_second"), item.get("burst")
        for name, v in (("requests_per_second", rate), ("burst", burst)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"{path}.{name}: must be a number > 0")
        limit = default_limit(float(rate), None if burst is None else float(burst)) \
            if rate is not None else default
        out[d] = KeyInfo(name=str(item.get("name") or f"key-{i}"), limit=limit)
    return APIKeys(out)


def load_api_keys(path: str, default: RateLimit | None) -> APIKeys:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"--api-keys-file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--api-keys-file {path}: not valid YAML: {e}") from None
    return parse_api_keys(data, f"--api-keys-file {path}", default)
