"""Native CPU kernels: C sources in ``csrc/``, built on first use with the machine's C compiler.

A kernel is compiled once per machine (``-O3 -march=native``, OpenMP) into a shared library
in a cache directory (``PAGEDSERVE_KERNEL_CACHE``, default ``~/.cache/pagedserve/kernels``),
named by a hash of its source, the flags, the compiler's version and the CPU's feature flags:
a changed source, compiler or CPU builds a new library, and a cache shared between machines
never hands one a library built for another's instructions. A build takes about a second;
concurrent builders each write their own temporary file and rename it into place.

The library is loaded with :mod:`ctypes`, whose calls release the GIL. Loaded after torch, it
shares torch's OpenMP runtime (the same ``libgomp.so.1``), so its threads are torch's threads.
Where no compiler is found, the build fails or ``PAGEDSERVE_CPU_NATIVE=0`` is set,
:func:`load` returns None (logged once) and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch  # noqa: F401  (first: a library loaded after it binds to its OpenMP runtime)

__all__ = ["CACHE_ENV", "CFLAGS", "LDFLAGS", "NATIVE_ENV", "load", "native_enabled"]

log = structlog.get_logger(__name__)

NATIVE_ENV = "PAGEDSERVE_CPU_NATIVE"
CACHE_ENV = "PAGEDSERVE_KERNEL_CACHE"
SOURCES = Path(__file__).with_name("csrc")
# Compiled with -ffast-math: the compiler vectorises reductions and calls glibc's vector exp
# and tanh; the kernels never produce or read infinities or NaNs (masked positions are not
# visited). Linked without it: a library linked with -ffast-math (GCC 12) carries
# crtfastmath.o, whose constructor sets flush-to-zero for the whole process when loaded.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-strict-aliasing", "-fopenmp", "-fPIC")
LDFLAGS = ("-shared", "-fopenmp")


def native_enabled() -> bool:
    """Whether native kernels may be used (``PAGEDSERVE_CPU_NATIVE`` is not ``0``)."""
    return os.environ.get(NATIVE_ENV, "1") != "0"


def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.c`` (built now if not cached), or None where
    native kernels are off or cannot be built here."""
    if not native_enabled():
        return None
    return _load(name, os.environ.get("CC") or "cc", os.environ.get(CACHE_ENV, ""))


@functools.cache
def _load(name: str, compiler: str, cache: str) -> ctypes.CDLL | None:
    source = SOURCES / f"{name}.c"
    try:
        path = _build(source, compiler, Path(cache) if cache else _default_cache())
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        log.warning("cpu_native_kernel_unavailable", kernel=name, reason=reason)
        return None


def _default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve" / "kernels"


def _build(source: Path, compiler: str, cache: Path) -> Path:
    exe = shutil.which(compiler)
    if exe is None:
        raise OSError(f"no C compiler {compiler!r} on PATH (set CC)")
    version = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(CFLAGS + LDFLAGS), version, _cpu_flags()):
        digest.update(part.encode() if isinstance(part, str) else part)
    path = cache / f"{source.stem}-{digest.hexdigest()[:20]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=cache)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for command in (
            [exe, *CFLAGS, "-c", "-o", obj, str(source)],
            [exe, *LDFLAGS, "-o", tmp, obj, "-lm"],
        ):
            proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise OSError(f"{compiler} failed on {source.name}: {proc.stderr.strip()}")
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    log.info("cpu_native_kernel_built", kernel=source.stem, path=str(path))
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for exactly these)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()
