"""Write ``docs/flags.md`` from the argparse parsers of every ``pagedserve`` command.

    .venv/bin/python -m pagedserve.tools.gen_flags           # rewrite docs/flags.md
    .venv/bin/python -m pagedserve.tools.gen_flags --check   # exit 1 when it is stale

The commands are those of ``services/cli.py`` (``SUBCOMMANDS``), in that order. A command
whose parser is built by a function of its own is read from that function (:data:`PARSERS`);
any other is read by calling the command's entry point with ``parse_args`` intercepted, so a
new subcommand appears here without a change to this file.

The output depends on the parsers alone: a default read from a ``PAGEDSERVE_*`` environment
variable is shown as that variable's name (the parsers are built with every such variable
reading as ``$NAME``), never as its value on the machine that ran the generator.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "flags.md"
ENV_PREFIX = "PAGEDSERVE_"
REGENERATE = ".venv/bin/python -m pagedserve.tools.gen_flags"

#: Subcommand -> ``module:attribute.path`` of a function that returns its parser.
PARSERS: dict[str, str] = {
    "blockmgr": "services.blockmgr.service.config:BlockManagerServiceConfig.parser",
    "executor": "services.executor.service.config:ExecutorConfig.parser",
    "gateway": "services.gateway.service.config:GatewayConfig.parser",
    "serve": "services.serve:_parser",
    "bench": "services.bench.serve:parser",
}


class EnvDefault(str):
    """A default read from an environment variable while the parsers were built."""

    @property
    def name(self) -> str:
        return self[1:]


class _EnvironByName(dict[str, str]):
    """``os.environ`` while parsers are built: each ``PAGEDSERVE_*`` variable reads ``$NAME``."""

    def __getitem__(self, key: str) -> str:
        if isinstance(key, str) and key.startswith(ENV_PREFIX):
            return EnvDefault(f"${key}")
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return (isinstance(key, str) and key.startswith(ENV_PREFIX)) or super().__contains__(key)


class _Captured(BaseException):  # not Exception: an entry point's `except Exception` lets it by
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


@contextmanager
def _env_by_name() -> Iterator[None]:
    environ = _EnvironByName({k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)})
    with mock.patch.object(os, "environ", environ):
        yield


def _resolve(target: str) -> Callable[..., Any]:
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


def _capture(entry_point: Callable[[list[str]], Any]) -> argparse.ArgumentParser | None:
    """The parser ``entry_point([])`` builds, taken as it is about to parse."""

    def intercept(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", intercept):
        try:
            entry_point([])
        except _Captured as captured:
            return captured.parser
    return None


def _subcommands() -> dict[str, tuple[str, str]]:
    from services.cli import SUBCOMMANDS

    return SUBCOMMANDS


def parsers() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(subcommand, one-line help, parser)`` for every ``pagedserve`` subcommand."""
    found = []
    for name, (target, summary) in _subcommands().items():
        module_name, _, func = target.partition(":")
        if name in PARSERS:
            factory = _resolve(PARSERS[name])
            with _env_by_name():
                parser = factory()
        else:
            module = importlib.import_module(module_name)
            entry_point = getattr(module, f"{func}_main" if func else "main")
            with _env_by_name():
                parser = _capture(entry_point)
            if parser is None:
                raise RuntimeError(
                    f"pagedserve {name}: no argparse parser found by calling its entry point; "
                    f"add the function that builds it to PARSERS in {__name__}"
                )
        found.append((name, summary, parser))
    return found


# ---- rendering ---------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("``", "`")).strip()


def _cell(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


def _value(value: Any) -> str:
    if isinstance(value, EnvDefault):
        return value
    if isinstance(value, enum.Enum):
        return _value(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, Path):
        return value.as_posix()
    if isinstance(value, list | tuple):
        return ",".join(_value(v) for v in value)
    return str(value)


def _default(action: argparse.Action) -> str:
    optional_positional = action.nargs in ("?", "*", argparse.REMAINDER)
    if action.required and not (not action.option_strings and optional_positional):
        return "required"
    default = action.default
    if isinstance(action, argparse.BooleanOptionalAction) and isinstance(default, bool):
        return "on" if default else "off"
    if action.nargs == 0 and isinstance(default, bool):  # store_true / store_false: not given
        return "off"
    if default is None or default is argparse.SUPPRESS or default == []:
        return ""
    if isinstance(default, EnvDefault):
        return f"env `{default.name}`"
    return f"`{_value(default)}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    # Python < 3.13 appends this to a BooleanOptionalAction's help; later versions do not.
    text = text.removesuffix(" (default: %(default)s)")
    if "%" in text:  # expand %(default)s and friends as argparse does
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        for key, value in list(params.items()):
            if hasattr(value, "__name__"):
                params[key] = value.__name__
        params["default"] = _value(action.default) if action.default is not None else None
        if action.choices is not None:
            params["choices"] = ", ".join(str(c) for c in action.choices)
        text = text % params
    if action.choices is not None:
        choices = ", ".join(f"`{_value(c)}`" for c in action.choices)
        text = f"{text.rstrip('.')}; one of {choices}" if text else f"one of {choices}"
    return text


def _flag(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    name = action.metavar if isinstance(action.metavar, str) else action.dest
    if action.nargs == argparse.REMAINDER:
        return f"`{name} ...` (after `--`)"
    if action.nargs in ("*", "+"):
        return f"`{name} ...`"
    if action.nargs == "?":
        return f"`[{name}]`"
    return f"`{name}`"


def _section(summary: str, parser: argparse.ArgumentParser) -> list[str]:
    about = f"{summary[:1].upper()}{summary[1:]}."
    if parser.description:
        about = parser.description.strip().split("\n\n")[0]
    lines = [f"## `{parser.prog}`", "", _one_line(about), ""]
    lines += ["| flag | default | help |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        row = (_flag(action), _default(action), _help(action, parser.prog))
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return [*lines, ""]


def render() -> str:
    """The whole of ``docs/flags.md``."""
    found = parsers()
    lines = [
        "<!-- Generated from the argparse parsers by `python -m pagedserve.tools.gen_flags`;",
        "     do not edit by hand: change the parser, then run the generator. -->",
        "",
        "# Flags",
        "",
        "Every `pagedserve` command and its flags, read from the parsers themselves "
        f"(regenerate with `{REGENERATE}`; `tests/test_docs.py` fails when this file is "
        "stale). A default shown as env `NAME` is read from that environment variable.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for _name, summary, parser in found:
        anchor = re.sub(r"[^a-z0-9 -]", "", parser.prog.lower()).replace(" ", "-")
        lines.append(f"| [`{parser.prog}`](#{anchor}) | {_cell(summary)} |")
    lines.append("")
    for _name, summary, parser in found:
        lines += _section(summary, parser)
    return "\n".join(lines).rstrip("\n") + "\n"


def check(path: Path = DEFAULT_OUTPUT) -> bool:
    """Whether ``path`` holds exactly what :func:`render` writes."""
    try:
        current = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return current == render()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pagedserve.tools.gen_flags",
        description="Write docs/flags.md from the argparse parsers of every pagedserve command.",
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="default docs/flags.md")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.check:
        if check(args.output):
            return 0
        print(f"{args.output} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1
    text = render()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
