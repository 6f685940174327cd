"""Every Triton kernel reads only globals that Triton's compiler accepts.

On a GPU, the compiler refuses a ``@triton.jit`` function that reads a plain module-level
value (``_C = 0.79``): only ``tl.constexpr(...)`` globals, modules, other jit functions and
triton.language objects may be read. The interpreter, which runs the kernels on the CPU,
does not check this, so a kernel could pass every CPU test and fail on its first GPU run
(it happened: ``gelu_tanh_and_mul``). This test applies the compiler's rule to the source.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import pagedserve.kernels  # noqa: E402

# A jit function, compiled (JITFunction) or, under TRITON_INTERPRET=1, interpreted.
_JIT = (triton.runtime.jit.KernelInterface, triton.runtime.jit.JITCallable)


def _jit_functions() -> list[tuple[str, object]]:
    found: dict[int, tuple[str, object]] = {}
    for info in pkgutil.iter_modules(pagedserve.kernels.__path__):
        module = importlib.import_module(f"pagedserve.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, _JIT) and value.fn.__module__ == module.__name__:
                found[id(value)] = (f"{module.__name__}.{name}", value)
    return sorted(found.values(), key=lambda item: item[0])


def _accepted(value: object) -> bool:
    """Triton's rule (``CodeGenerator.global_lookup``) for a global read inside a kernel."""
    return (
        isinstance(value, (ModuleType, tl.constexpr, tl.dtype, *_JIT))
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__module__", "").startswith("triton.language")
    )


def _rejected_globals(fn: object) -> list[str]:
    python_fn = fn.fn  # type: ignore[attr-defined]
    tree = ast.parse(textwrap.dedent(inspect.getsource(python_fn)))
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    local = {a.arg for a in (*func.args.args, *func.args.kwonlyargs)}
    body = ast.Module(body=func.body, type_ignores=[])
    local |= {
        n.id for n in ast.walk(body) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    return sorted(
        {
            n.id
            for n in ast.walk(body)
            if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)
            and n.id not in local
            and n.id in python_fn.__globals__
            and not _accepted(python_fn.__globals__[n.id])
        }
    )


def test_the_kernels_are_found() -> None:
    names = [name for name, _ in _jit_functions()]
    assert len(names) >= 10
    assert "pagedserve.kernels.silu_and_mul._silu_and_mul_kernel" in names


@pytest.mark.parametrize(
    "name, fn",
    [
        pytest.param(name, fn, id=name.removeprefix("pagedserve.kernels."))
        for name, fn in _jit_functions()
    ],
)
def test_a_kernel_reads_only_globals_the_gpu_compiler_accepts(name: str, fn: object) -> None:
    assert _rejected_globals(fn) == [], (
        f"{name} reads plain module globals; make them tl.constexpr(...)"
    )
