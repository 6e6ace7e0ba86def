"""`pagefleet` entry point: serve | gateway | bench serve | operator | crd.

Flags come from the config dataclasses (server/config.py), so `pagefleet serve --help`
is generated from the same place the YAML config and the operator read. A `--config`
file is turned into the command line it stands for and parsed by the same parser, and
vLLM's spellings (aliases, ignored and refused flags, `--flag false`) are rewritten
for both by `normalize_flags`, from the tables in config.py. Heavy imports
(torch, kopf) happen inside the subcommand that needs them: the operator image has no
torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any, NoReturn

from pagefleet.server.config import (
    FLAG_ALIASES,
    IGNORED_FLAGS,
    IGNORED_ONLY_WITH,
    UNSUPPORTED_FLAGS,
    ConfigError,
    EngineConfig,
    ServerConfig,
    base_type,
    config_fields,
    flag_name,
    human_readable_int,
)


class FlagParser(argparse.ArgumentParser):
    """argparse with a short refusal: its usual usage block lists every flag (about 50
    lines for `serve`), burying the one line that says what was wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"('{self.prog} --help' lists the flags)\n")


def machine_defaults() -> dict[str, str]:
    """What the by-device defaults resolve to here (for --help), without CUDA."""
    from pagefleet.server.config import default_block_size, default_limits, probe_gpu

    mem, cap = probe_gpu()
    where = f"a {mem / (1 << 30):.0f} GiB GPU" if mem else "no GPU"
    seqs, server = default_limits("server", mem)
    _, offline = default_limits("offline", mem)
    arch = f"a GPU of compute capability {cap[0]}.{cap[1]}" if cap else "no GPU"
    return {"max_num_seqs": f"{seqs} on this machine ({where})",
            "max_num_batched_tokens": f"{server} for the server, {offline} for the offline "
                                      f"LLM on this machine ({where})",
            "block_size": f"{default_block_size(cap)} on this machine ({arch})"}


def add_config_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                     here: dict[str, str] | None = None) -> None:
    group = parser.add_argument_group(cls.__name__)
    here = here or {}
    for f, tp in config_fields(cls):
        if f.name in skip:
            continue
        kind = base_type(tp)
        default = here.get(f.name, f.default)
        text = f.metadata["help"]
        if f.metadata.get("human"):
            text += " Takes vLLM's suffixes: 32k = 32,000, 32K = 32,768 (k/m/g/t, K/M/G/T)."
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                                  "help": text + f" (default: {default})"}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif getattr(kind, "__origin__", None) is list:
            kwargs["type"] = str
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = human_readable_int if f.metadata.get("human") else kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        group.add_argument(flag_name(f), **kwargs)


def _compat_epilog(parser: argparse.ArgumentParser) -> str:
    """The vLLM spellings `normalize_flags` handles before argparse, for `--help`: they
    are no parser options, so argparse would not list them, and `--help` is the
    reference."""
    wrap = textwrap.TextWrapper(width=88, initial_indent="    ", subsequent_indent="      ",
                               break_on_hyphens=False, break_long_words=False)
    nargs = {o: a for a in parser._actions for o in a.option_strings}

    def arg(flag: str) -> str:
        action = nargs.get(flag)
        takes = action is not None and not isinstance(action, argparse.BooleanOptionalAction)
        return f"{flag} N" if takes else flag

    lines = ["vLLM compatibility (on the command line and in --config files):",
             "  boolean flags also take a value, as older vLLM's did: "
             "--enable-chunked-prefill False,", "  --enable-prefix-caching=true",
             "  aliases:"]
    for alias, target in FLAG_ALIASES.items():
        suffix = arg(target)[len(target):]
        lines.append(f"    {alias + suffix:30} same as {target + suffix}")
    lines.append("  accepted for vLLM compatibility, ignored (one notice line at startup):")
    lines.append(wrap.fill(", ".join(f"{flag}{' N' if takes else ''}"
                                     for flag, takes in IGNORED_FLAGS.items()
                                     if flag not in IGNORED_ONLY_WITH)))
    lines.append(wrap.fill(", ".join(f"{flag} {'|'.join(ok)}"
                                     for flag, (ok, _) in IGNORED_ONLY_WITH.items())
                           + " (other values are refused, with the reason)"))
    lines.append("  refused, with the reason (vLLM features pagefleet does not have):")
    lines += [wrap.fill(f"{flag}: {why.removeprefix('not supported: ')}")
              for flag, why in UNSUPPORTED_FLAGS.items()]
    return "\n".join(lines)


def serve_parser(help_text: bool = False) -> argparse.ArgumentParser:
    """The serve flags; `help_text` resolves the by-device defaults for --help."""
    p = FlagParser(
        prog="pagefleet serve", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model behind an OpenAI-compatible API. Flags match vLLM's.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Local HF model directory or Hugging Face repo id. "
                        "Omit to serve the built-in demo model.")
    p.add_argument("--config", default=None, help="YAML file with the same keys as the flags "
                   "(dashes or underscores) and the same values, read as the command line "
                   "reads them; flags on the command line win.")
    add_config_flags(p, EngineConfig, here=machine_defaults() if help_text else None)
    add_config_flags(p, ServerConfig)
    p.epilog = _compat_epilog(p)
    return p


def gateway_parser() -> argparse.ArgumentParser:
    from pagefleet.server.gateway.config import GatewayConfig

    p = FlagParser(
        prog="pagefleet gateway", allow_abbrev=False,
        description="One OpenAI-compatible endpoint for every model: prefix-affinity "
                    "routing with bounded load, long/short pools, admission, weighted "
                    "rollouts, scale-from-zero holding. See docs/gateway.md.")
    p.add_argument("--config", default=None, help="YAML file with the same keys as the flags "
                   "(dashes or underscores) and the same values, read as the command line "
                   "reads them; flags on the command line win.")
    add_config_flags(p, GatewayConfig)
    return p


def build_gateway_config(argv: list[str]):
    """Parse `gateway` argv into a validated GatewayConfig: defaults < YAML < flags."""
    from pagefleet.server.gateway.config import GatewayConfig

    values, _ = parse_flags(gateway_parser(), argv, vllm=False)
    cfg = GatewayConfig(**values)
    cfg.validate()
    return cfg


_BOOL_WORDS = {"true": True, "false": False}


def normalize_flags(argv: list[str], parser: argparse.ArgumentParser, *,
                    vllm: bool = True) -> tuple[list[str], list[str]]:
    """Rewrite argv into what `parser` takes; return (argv, notices).

    Why before argparse: these are vLLM spellings, not settings of ours, and `--config`
    files go through here too (`config_file_argv`), so both read them alike.
    - `--FLAG=true|false` and `--FLAG true|false` on a boolean flag (older vLLM took a
      value: `--enable-chunked-prefill False`) become `--FLAG` / `--no-FLAG`; any other
      `=value` is an error naming the flag. A following word is taken only if it is
      true or false, so `--enforce-eager ./model` keeps its positional model.
    With `vllm` (the server; the gateway has no vLLM heritage):
    - FLAG_ALIASES are renamed; IGNORED_FLAGS are dropped with their values and a
      notice (IGNORED_ONLY_WITH refuses the values that would change outputs);
      UNSUPPORTED_FLAGS are a ConfigError saying why."""
    bools: dict[str, tuple[str, bool]] = {}
    for action in parser._actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = action.option_strings[0]
            for option in action.option_strings:
                bools[option] = (positive, option == positive)
    out: list[str] = []
    notices: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":                       # the rest are positionals, as in argparse
            out += argv[i - 1:]
            break
        if not tok.startswith("-"):
            out.append(tok)
            continue
        name, eq, value = tok.partition("=")
        if vllm and name in FLAG_ALIASES:
            name = FLAG_ALIASES[name]
            tok = name + eq + value
        if vllm and name in UNSUPPORTED_FLAGS:
            raise ConfigError(f"{name}: {UNSUPPORTED_FLAGS[name]}")
        if vllm and name in IGNORED_FLAGS:
            if IGNORED_FLAGS[name] and not eq:
                if i >= len(argv) or argv[i].startswith("--"):
                    raise ConfigError(f"{name}: expected a value")
                value = argv[i]
                i += 1
            if name in IGNORED_ONLY_WITH:
                ok, why = IGNORED_ONLY_WITH[name]
                if value not in ok:
                    raise ConfigError(f"{name} {value}: not supported: {why} (accepted and "
                                      f"ignored: {', '.join(ok)})")
            notices.append(f"{name} is accepted for vLLM compatibility and has no effect here")
            continue
        if name in bools:
            positive, is_positive = bools[name]
            if eq:
                given = _BOOL_WORDS.get(value.lower())
                if given is None:
                    raise ConfigError(f"{name}: expected true or false, got {value!r}")
            elif i < len(argv) and argv[i].lower() in _BOOL_WORDS:
                given = _BOOL_WORDS[argv[i].lower()]
                i += 1
            else:
                out.append(tok)
                continue
            on = given if is_positive else not given
            out.append(positive if on else "--no-" + positive[2:])
            continue
        out.append(tok)
    return out, notices


def config_file_argv(path: str, parser: argparse.ArgumentParser, *,
                     vllm: bool = True) -> list[str]:
    """A `--config` YAML file as the command line it stands for (vLLM does the same), so
    a key takes exactly what its flag takes and is converted by the same parser:
    `max-model-len: "8192"` and `32k` are numbers, `enable-prefix-caching: "false"` is
    false, vLLM's aliases and ignored flags work, and a bad value is argparse's error
    naming the flag. true gives `--KEY`, false `--KEY=false` (`normalize_flags` makes
    that `--no-KEY`), a list the flag's values, a mapping its JSON; null keeps the
    default. Keys are flag names, dashes or underscores (field names such as
    num_kv_blocks also work)."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    options = parser._option_string_actions
    by_dest = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    known = set(options)
    if vllm:
        known |= set(FLAG_ALIASES) | set(IGNORED_FLAGS) | set(UNSUPPORTED_FLAGS)
    argv: list[str] = []
    unknown: list[str] = []
    for key, value in data.items():
        key = str(key)
        flag = key if key.startswith("-") else "--" + key.replace("_", "-")
        if flag not in known:
            flag = by_dest.get(key.lstrip("-").replace("-", "_"), flag)
        if flag not in known or flag in ("--config", "-h", "--help"):
            unknown.append(key)
            continue
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append(flag + "=false")
        elif isinstance(value, (list, tuple)):
            action = options.get(flag)
            if action is None or action.nargs not in ("+", "*"):
                raise ConfigError(f"--config {path}: {key}: expected one value, not a list")
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={value}")
    if unknown:
        raise ConfigError(f"--config {path}: unknown setting(s): {', '.join(unknown)} (the "
                          "keys are the flag names that --help lists)")
    return argv


def parse_flags(parser: argparse.ArgumentParser, argv: list[str], *,
                vllm: bool) -> tuple[dict[str, Any], list[str]]:
    """The settings argv gives (defaults < `--config` file < command line) and the
    notices for ignored vLLM flags. Only explicitly given flags are in the result (the
    parser's defaults are SUPPRESS), plus `model_tag` (None when absent) for serve."""
    kept, notices = normalize_flags(argv, parser, vllm=vllm)
    given = vars(parser.parse_args(kept))
    path = given.pop("config", None)
    values: dict[str, Any] = {}
    if path:
        file_argv = config_file_argv(path, parser, vllm=vllm)

        def refuse(message: str) -> NoReturn:
            raise ConfigError(message)

        own = parser.__dict__.get("error")        # a caller's override, kept
        parser.error = refuse  # type: ignore[method-assign]
        try:
            file_kept, file_notices = normalize_flags(file_argv, parser, vllm=vllm)
            values = vars(parser.parse_args(file_kept))
        except ConfigError as e:
            raise ConfigError(f"--config {path}: {e}") from None
        finally:
            if own is None:
                del parser.error
            else:
                parser.error = own  # type: ignore[method-assign]
        values.pop("config", None)
        values.pop("model_tag", None)
        notices += file_notices
    values.update(given)
    return values, notices


def build_configs(argv: list[str]) -> tuple[EngineConfig, ServerConfig, list[str]]:
    """Parse `serve` argv into validated configs: defaults < YAML file < flags."""
    parser = serve_parser(help_text=any(a in ("-h", "--help") for a in argv))
    values, notices = parse_flags(parser, argv, vllm=True)
    model_tag = values.pop("model_tag", None)
    if model_tag:
        values["model"] = model_tag
    engine_names = {f.name for f, _ in config_fields(EngineConfig)}
    server_names = {f.name for f, _ in config_fields(ServerConfig)}
    engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
    server = ServerConfig(**{k: v for k, v in values.items() if k in server_names})
    engine.validate()
    server.validate()
    return engine, server, notices


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = "serve | gateway | bench serve | operator | crd"
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
    if cmd == "gateway":
        try:
            cfg = build_gateway_config(rest)
        except ConfigError as e:
            print(f"pagefleet gateway: error: {e}", file=sys.stderr)
            return 2
        from pagefleet.server.gateway.serve import run_gateway

        return run_gateway(cfg)
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
