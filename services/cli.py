"""The ``pagedserve`` command: one entry point, one subcommand per service or tool.

Each subcommand lives in its own module exposing ``main(argv: list[str]) -> int``; modules are
imported lazily so that ``pagedserve blockmgr`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "blockmgr": ("services.blockmgr.__main__", "run the KV block manager gRPC service"),
    "executor": ("services.executor.__main__", "run the executor (scheduler + model) service"),
    "gateway": ("services.gateway.__main__", "run the public gRPC API in front of executors"),
    "serve": ("services.serve", "run blockmgr + executor + gateway as supervised processes"),
    "generate": ("services.client_cli:generate", "stream a completion from a gateway"),
    "chat": ("services.client_cli:chat", "stream a chat reply from a gateway"),
    "bench": ("services.bench.__main__", "measure a running deployment (bench serve)"),
    "make-tiny-model": (
        "pagedserve.tools.tiny_model",
        "write a tiny random Llama checkpoint with a real tokenizer",
    ),
}


def _usage() -> str:
    lines = ["usage: pagedserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"pagedserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target = SUBCOMMANDS[name][0]
    module_name, _, func = target.partition(":")
    module = importlib.import_module(module_name)
    return int(getattr(module, f"{func}_main" if func else "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
