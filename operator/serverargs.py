"""`pagefleet serve` arguments as the server itself reads them.

The operator renders args and lets users append `extraArgs`; what matters is what the
server will do with the result, so both checks here run the server's own parser
(`pagefleet.server.cli.serve_parser()`, which has `allow_abbrev=False`):

- `check_extra()`: an extraArgs list may not set a flag the operator owns, however it
  is spelled (`--port=9000`, `--port 9000`); an abbreviation (`--po 9000`) or an
  unknown flag is refused with the parser's message instead of crashing the pod;
- `effective()`: the value a setting ends up with (the last occurrence wins, as in
  argparse), so the grace period follows `--shutdown-timeout` and the tensor-parallel
  size check sees the flag wherever it was given.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from pagefleet.server.cli import normalize_flags, serve_parser
from pagefleet.server.config import ConfigError, EngineConfig, ServerConfig, default_limits

# dest -> why the operator owns it.
RESERVED: dict[str, str] = {
    "host": "the operator sets it (probes and the Service use the pod IP)",
    "port": "the operator sets it (probes, the Service and the autoscaler use port 8000)",
    "served_model_name": "use spec.servedModelName",
    "api_key": "use spec.apiKeySecretRef",
    "config": "the operator must see every flag (use spec.engine fields or extraArgs)",
}


class ArgsError(ValueError):
    """The server's parser refused the args; the message is argparse's."""


def _parser() -> argparse.ArgumentParser:
    p = serve_parser()

    def error(message: str) -> None:  # argparse would print and exit
        raise ArgsError(message)

    p.error = error  # type: ignore[method-assign]
    return p


def parse(argv: Sequence[str]) -> dict[str, Any]:
    """Explicitly given settings only (the parser's defaults are SUPPRESS), after the
    vLLM spellings are rewritten as the server rewrites them (`cli.normalize_flags`:
    aliases, `--flag=false`, ignored flags dropped; a refused vLLM flag is an
    ArgsError with the server's reason)."""
    p = _parser()
    try:
        kept, _ = normalize_flags(list(argv), p)
    except ConfigError as e:
        raise ArgsError(str(e)) from None
    ns = vars(p.parse_args(kept))
    # The positional model and --config default to None rather than SUPPRESS.
    return {k: v for k, v in ns.items() if not (k in ("model_tag", "config") and v is None)}


def flag_of(dest: str) -> str:
    for action in serve_parser()._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return dest


def check_extra(extra: Sequence[str]) -> dict[str, Any]:
    """The settings an extraArgs list makes; ArgsError when it is not acceptable."""
    given = parse(extra)
    if given.get("model_tag") is not None:
        raise ArgsError(f"unexpected positional argument {given['model_tag']!r} (the model is spec.model)")
    for dest, why in RESERVED.items():
        if dest in given:
            raise ArgsError(f"must not set {flag_of(dest)}: {why}")
    return given


_DEFAULTS = {f.name: f.default for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)}


def effective(argv: Sequence[str], name: str) -> Any:
    """What the server will use for config field `name` given the full argv."""
    return parse(argv).get(name, default(name))


def default(name: str) -> Any:
    """The server's default for a config field. The batch limits the server picks by
    device (`config.default_limits`: `--max-num-seqs` 256, or 1024 on GPUs of 70 GiB
    and more) are unknown to the operator, which takes the smaller device's value."""
    value = _DEFAULTS[name]
    if value is None and name in ("max_num_seqs", "max_num_batched_tokens"):
        seqs, tokens = default_limits("server", None)
        return seqs if name == "max_num_seqs" else tokens
    return value
