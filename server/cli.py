"""`pagefleet` entry point: serve | bench serve | operator | crd.

Flags come from the config dataclasses (server/config.py), so `pagefleet serve --help`
is generated from the same place the YAML config and the operator read. Heavy imports
(torch, kopf) happen inside the subcommand that needs them: the operator image has no
torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagefleet.server.config import (
    FLAG_ALIASES,
    IGNORED_FLAGS,
    ConfigError,
    EngineConfig,
    ServerConfig,
    base_type,
    config_fields,
    flag_name,
)


def add_config_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(cls.__name__)
    for f, tp in config_fields(cls):
        if f.name in skip:
            continue
        kind = base_type(tp)
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                                  "help": f.metadata["help"] + f" (default: {f.default})"}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif getattr(kind, "__origin__", None) is list:
            kwargs["type"] = str
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        group.add_argument(flag_name(f), *f.metadata.get("aliases", ()), **kwargs)


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagefleet serve", allow_abbrev=False,
        description="Serve a model behind an OpenAI-compatible API. Flags match vLLM's.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Local HF model directory or Hugging Face repo id. "
                        "Omit to serve the built-in demo model.")
    p.add_argument("--config", default=None, help="YAML file with the same keys as the flags "
                   "(dashes or underscores); flags on the command line win.")
    add_config_flags(p, EngineConfig)
    add_config_flags(p, ServerConfig)
    return p


def strip_ignored_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Drop flags older vLLM took and that mean nothing here; return (argv, notices)."""
    out, notices, i = [], [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in FLAG_ALIASES:
            alias = FLAG_ALIASES[name]
            argv = argv[:i] + [alias + argv[i][len(name):]] + argv[i + 1:]
            name = alias
        if name in IGNORED_FLAGS:
            takes = IGNORED_FLAGS[name] if "=" not in argv[i] else 0
            notices.append(f"{name} is accepted for vLLM compatibility and has no effect here")
            i += 1 + takes
            continue
        out.append(argv[i])
        i += 1
    return out, notices


def load_yaml_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_configs(argv: list[str]) -> tuple[EngineConfig, ServerConfig, list[str]]:
    """Parse `serve` argv into validated configs: defaults < YAML file < flags."""
    argv, notices = strip_ignored_flags(argv)
    ns = vars(serve_parser().parse_args(argv))
    values: dict[str, Any] = {}
    if ns.get("config"):
        values.update(load_yaml_config(ns["config"]))
    values.update({k: v for k, v in ns.items() if k not in ("config", "model_tag")})
    if ns.get("model_tag"):
        values["model"] = ns["model_tag"]
    engine_names = {f.name for f, _ in config_fields(EngineConfig)}
    server_names = {f.name for f, _ in config_fields(ServerConfig)}
    unknown = set(values) - engine_names - server_names
    if unknown:
        raise ConfigError(f"unknown setting(s) in --config: {', '.join(sorted(unknown))}")
    if isinstance(values.get("served_model_name"), str):   # YAML may give one name
        values["served_model_name"] = [values["served_model_name"]]
    engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
    server = ServerConfig(**{k: v for k, v in values.items() if k in server_names})
    engine.validate()
    return engine, server, notices


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = "serve | bench serve | operator | crd"
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: pagefleet {{{commands}}} ...")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        try:
            engine, server, notices = build_configs(rest)
        except ConfigError as e:
            print(f"pagefleet serve: error: {e}", file=sys.stderr)
            return 2
        from pagefleet.server.api.serve import run_serve

        return run_serve(engine, server, notices)
    if cmd == "bench":
        from pagefleet.server.bench.cli import main as bench_main

        return bench_main(rest)
    if cmd in ("operator", "crd"):
        from pagefleet.operator.cli import main as operator_main

        return operator_main(cmd, rest)
    print(f"pagefleet: unknown command {cmd!r}; expected one of: {commands}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
