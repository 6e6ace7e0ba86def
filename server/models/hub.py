"""Turn `pagefleet serve MODEL` into a local directory.

MODEL is a local HF-format directory, or a Hugging Face repo id (`org/name`) fetched
with `huggingface_hub` into its usual cache (`HF_HOME`, `HF_HUB_CACHE`), honouring
`--revision` and `HF_TOKEN`. Production pods usually pre-sync weights to a volume; the
Hub path is there so that vLLM launch lines keep working.

Failing fast matters more than retrying here: a pod that hangs on a DNS lookup looks
alive to Kubernetes. So network timeouts are short (`HF_HUB_ETAG_TIMEOUT`, default 10
s here), `HF_HUB_OFFLINE=1` uses the cache only, and every failure becomes a
`ModelNotFoundError` with a message that says what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Only what the engine reads: config, weights, tokenizer, generation defaults.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken",
                  "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(RuntimeError):
    """MODEL is neither a usable local directory nor fetchable from the Hub."""


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def resolve_model(name: str, revision: str | None = None, *, what: str = "model") -> Path:
    """A local directory for `name` (a path or a Hub repo id); raises ModelNotFoundError."""
    path = Path(name).expanduser()
    if path.is_dir():
        if what == "model" and not (path / "config.json").exists():
            raise ModelNotFoundError(f"{what} directory {str(path)!r} has no config.json; "
                                     "point MODEL at a Hugging Face format checkpoint")
        return path
    if path.exists():
        kind = " (a GGUF file, which is not supported)" if path.suffix == ".gguf" else ""
        raise ModelNotFoundError(f"{what} {name!r} is a file{kind}; expected a directory or a "
                                 "Hugging Face repo id")
    if not looks_like_repo_id(name):
        raise ModelNotFoundError(f"{what} {name!r}: no such directory, and not a Hugging "
                                 "Face repo id (org/name)")
    return _download(name, revision, what)


def _download(repo_id: str, revision: str | None, what: str) -> Path:
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import constants
    except ImportError as e:  # pragma: no cover - a server install always has it
        raise ModelNotFoundError(f"{what} {repo_id!r} looks like a Hub repo id but "
                                 "huggingface_hub is not installed") from e
    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") \
        else constants.HF_HUB_OFFLINE
    rev = f" (revision {revision})" if revision else ""
    try:
        local = snapshot_download(repo_id, revision=revision,
                                  token=os.environ.get("HF_TOKEN") or None,
                                  allow_patterns=ALLOW_PATTERNS,
                                  etag_timeout=float(os.environ["HF_HUB_ETAG_TIMEOUT"]))
    except Exception as e:  # noqa: BLE001 - every failure gets the same clear advice
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
        if offline:
            hint = ("HF_HUB_OFFLINE is set and the repo is not in the local cache "
                    f"({constants.HF_HUB_CACHE})")
        else:
            hint = (f"the Hub at {constants.ENDPOINT} could not be reached or refused the "
                    "request (check the network, HF_ENDPOINT, HF_TOKEN for gated repos, "
                    "and the repo id)")
        raise ModelNotFoundError(
            f"could not fetch {what} {repo_id!r}{rev} from the Hugging Face Hub: {hint}. "
            "Download it where there is network (`huggingface-cli download "
            f"{repo_id}`) into the cache or a local directory and pass that directory. "
            f"[{reason}]") from e
    return Path(local)
