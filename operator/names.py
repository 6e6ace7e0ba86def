"""Names of the objects a ModelDeployment owns.

A ModelDeployment may be called anything a DNS subdomain allows (`qwen2.5-7b`, up to
253 characters), but a Service name must be a DNS-1035 label (lowercase letters,
digits and '-', starting with a letter, at most 63), and so must label values. A name
that already is one is used as is; any other is made into one, with a short hash of
the original so that `qwen2.5-7b` and `qwen2-5-7b` never share children.
"""

from __future__ import annotations

import hashlib
import re

MAX_LABEL = 63
_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def is_service_name(name: str) -> bool:
    return len(name) <= MAX_LABEL and bool(_LABEL.match(name))


def child_name(name: str) -> str:
    """`qwen-short` -> `qwen-short`; `qwen2.5-7b` -> `qwen2-5-7b-<hash5>`."""
    if is_service_name(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:5]
    base = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not base or not base[0].isalpha():
        base = "m-" + base
    base = base[:MAX_LABEL - len(digest) - 1].rstrip("-")
    return f"{base}-{digest}"
