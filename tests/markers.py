"""The suite's speed markers, set at collection from what each test does, never by hand.

- ``e2e``: the test starts processes (a service, the CLI, ``pagedserve serve``, torch ranks of
  a tensor-parallel runner, a container runner).
- ``interp``: it runs Triton kernels (under the interpreter without CUDA).
- ``matrix``: it is one case past the first of a sweep (a test run for two models,
  families or configurations or more): the first case stays in the fast loop.

What a test does is read from its source, the sources of the fixtures it uses and of the
helpers of the test suite it calls, transitively: a name that starts processes or runs a
Triton kernel anywhere in that closure marks it. ``make test-fast`` deselects all three.
"""

from __future__ import annotations

import collections
import inspect
import io
import re
import textwrap
import tokenize
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest

MARKERS = {
    "e2e": "starts processes (services, CLI, torch ranks); set by tests/markers.py",
    "interp": "runs Triton kernels (the interpreter without CUDA); set by tests/markers.py",
    "matrix": "a case past the first of a sweep of models or configurations; tests/markers.py",
}

# Calls that start a process, as they appear in the suite's sources.
_STARTS_PROCESSES = re.compile(
    r"\bsubprocess\.|\bPopen\(|\bServiceProcess\b|\bServeStack\b|\brun_cli\(|\bserve_command\("
    r"|\bmp\.spawn\b|\bmultiprocessing\b|\bComposeRunner\b"
    r"|tensor_parallel_size\s*=\s*(?!1\b)[\w(]|\btp_size\s*=\s*(?!1\b)[\w(]"
)
_RUNS_TRITON = re.compile(r"_triton\b|\bPAGEDSERVE_FORCE_TRITON\b|\bFORCE_TRITON_ENV\b|\btriton\.")
_SWEEP_MIN_CASES = 2
# Parameters that sweep models, families or configurations (``name``: a tiny checkpoint or an
# engine configuration; the others: the engine's transport, scheduling and dtypes).
_SWEEP_PARAMS = {
    *("name", "family", "arch", "checkpoint", "model", "config", "configuration"),
    *("transport", "async_scheduling", "dtype"),
}


def _source(obj: Any) -> str:
    """``obj``'s code with its comments and docstrings blanked (prose may name what code
    does)."""
    try:
        lines = textwrap.dedent(inspect.getsource(obj)).splitlines(keepends=True)
    except (OSError, TypeError):
        return ""
    prose: list[tuple[tuple[int, int], tuple[int, int]]] = []
    statement_start = True
    try:
        for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and statement_start):
                prose.append((tok.start, tok.end))
            if tok.type not in (tokenize.NL, tokenize.COMMENT):
                statement_start = tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return "".join(lines)
    for (row, col), (end_row, end_col) in reversed(prose):
        if row == end_row:
            line = lines[row - 1]
            lines[row - 1] = line[:col] + " " * (end_col - col) + line[end_col:]
        else:
            lines[row - 1] = lines[row - 1][:col] + "\n"
            for r in range(row, end_row - 1):
                lines[r] = "\n"
            lines[end_row - 1] = " " * end_col + lines[end_row - 1][end_col:]
    return "".join(lines)


def _suite_helpers(func: Callable[..., Any]) -> Iterable[Any]:
    """The functions and classes of the test suite that ``func`` refers to by global name."""
    module = inspect.getmodule(func)
    names = set(getattr(getattr(func, "__code__", None), "co_names", ()))
    for const in getattr(getattr(func, "__code__", None), "co_consts", ()):
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            names |= set(const.co_names)
    for name in names:
        value = getattr(module, name, None)
        if value is None or not (inspect.isfunction(value) or inspect.isclass(value)):
            continue
        if (getattr(value, "__module__", "") or "").startswith(("tests.", "pagedserve.testing")):
            yield value


class _Classifier:
    """What a function does, memoised over the suite's functions (a closure is read once)."""

    def __init__(self) -> None:
        self._seen: dict[Any, tuple[bool, bool]] = {}

    def does(self, func: Any) -> tuple[bool, bool]:
        """(starts processes, runs Triton) for ``func`` and the suite helpers it calls."""
        func = inspect.unwrap(func) if callable(func) else func
        if func in self._seen:
            return self._seen[func]
        self._seen[func] = (False, False)  # cycles: what the rest of the closure says
        text = _source(func)
        procs, triton = bool(_STARTS_PROCESSES.search(text)), bool(_RUNS_TRITON.search(text))
        for helper in _suite_helpers(func) if not (procs and triton) else ():
            p, t = self.does(helper)
            procs, triton = procs or p, triton or t
        if inspect.isclass(func):
            for member in vars(func).values():
                if inspect.isfunction(member):
                    p, t = self.does(member)
                    procs, triton = procs or p, triton or t
        self._seen[func] = (procs, triton)
        return procs, triton


def _fixture_functions(item: pytest.Item) -> Iterable[Any]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name in item.fixturenames:  # type: ignore[attr-defined]
        for fixturedef in info.name2fixturedefs.get(name, ()):
            yield fixturedef.func


def _sweep_key(item: pytest.Item) -> Any:
    """The test function an item is a case of, if it is a case of a sweep: parametrized
    (directly or through a fixture) over a model, a family or a configuration."""
    callspec = getattr(item, "callspec", None)
    function = getattr(item, "function", None)
    if callspec is None or function is None or not _SWEEP_PARAMS & set(callspec.params):
        return None
    return (item.module, item.cls, function.__name__)  # type: ignore[attr-defined]


def mark_by_behaviour(items: list[pytest.Item]) -> None:
    """Add ``e2e``, ``interp`` and ``matrix`` to the collected ``items``."""
    classify = _Classifier()
    sweeps = collections.Counter(key for item in items if (key := _sweep_key(item)) is not None)
    seen: set[Any] = set()
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        procs, triton = classify.does(function)
        for fixture in _fixture_functions(item):
            if procs and triton:
                break
            p, t = classify.does(fixture)
            procs, triton = procs or p, triton or t
        if procs:
            item.add_marker(pytest.mark.e2e)
        if triton:
            item.add_marker(pytest.mark.interp)
        key = _sweep_key(item)
        if key is not None and sweeps[key] >= _SWEEP_MIN_CASES:
            if key in seen:
                item.add_marker(pytest.mark.matrix)
            seen.add(key)
