"""The LoRA adapters as the public APIs see them: listed always (behind the API key), loaded
and unloaded on every executor only with ``--allow-runtime-lora-updating``; an executor's
refusal becomes the gateway's error of the same kind."""

from __future__ import annotations

import grpc

from services.common.limits import FieldError
from services.common.lora import check_lora_name
from services.gateway.core.generation import ErrorKind, GenerationError
from services.gateway.fleet.adapters import AdapterCallError, AdapterFleet, AdapterSummary
from services.gateway.fleet.executor_client import ExecutorPool

__all__ = ["RUNTIME_UPDATES_FLAG", "AdapterService"]

RUNTIME_UPDATES_FLAG = "--allow-runtime-lora-updating"
_KIND = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: ErrorKind.ALREADY_EXISTS,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.UNAVAILABLE,
}


class AdapterService:
    def __init__(self, pool: ExecutorPool, allow_runtime_updates: bool) -> None:
        self.fleet = AdapterFleet(pool)
        self.pool = pool
        self.allow_runtime_updates = allow_runtime_updates

    def names(self) -> set[str]:
        """The adapters some ready executor serves (as last read: no call)."""
        return {name for conn in self.pool.ready for name in conn.adapters}

    def parent_of(self, name: str) -> str | None:
        """The path an adapter was loaded from, on the first executor serving it."""
        serving = self.fleet.serving(name)
        return serving[0].adapters[name].path if serving else None

    async def load(self, name: str, path: str, replace: bool = False) -> AdapterSummary:
        self._check_updates()
        try:
            check_lora_name(name)
            if not path:
                raise FieldError("lora_path", "is required")
        except FieldError as exc:
            raise GenerationError.invalid(exc) from None
        try:
            infos = await self.fleet.load(name, path, replace)
        except AdapterCallError as exc:
            raise _error(exc) from None
        return AdapterSummary.of(name, infos)

    async def unload(self, name: str) -> None:
        self._check_updates()
        try:
            await self.fleet.unload(name)
        except AdapterCallError as exc:
            raise _error(exc) from None

    async def listing(self) -> list[AdapterSummary]:
        try:
            return await self.fleet.listing()
        except AdapterCallError as exc:
            raise _error(exc) from None

    def _check_updates(self) -> None:
        if not self.allow_runtime_updates:
            raise GenerationError(
                ErrorKind.PERMISSION_DENIED,
                f"loading and unloading adapters at runtime is off: start the gateway with "
                f"{RUNTIME_UPDATES_FLAG}",
            )


def _error(exc: AdapterCallError) -> GenerationError:
    kind = _KIND.get(exc.code, ErrorKind.INTERNAL)
    field = exc.message.partition(":")[0] if kind is ErrorKind.INVALID_ARGUMENT else None
    field = {"name": "lora_name", "path": "lora_path"}.get(field or "", field)
    return GenerationError(kind, exc.message, field)
