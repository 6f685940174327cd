"""``pagedserve bench <what>``: ``serve`` measures a running deployment."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagedserve bench serve [options]   (pagedserve bench serve --help)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"pagedserve bench: unknown benchmark {argv[0]!r}; try `serve`", file=sys.stderr)
        return 2
    from services.bench.serve import main as serve_main

    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
