"""The adapters an executor serves: names, their versions, their identity in the prefix cache,
and which of them are kept in host memory.

A name points at one *version* of an adapter: the weights read from a directory when it was
loaded, under an id never reused. Loading a name again (``replace``) makes a new version: the
requests already running keep the old one until they finish, new requests get the new one.
A version's identity in the prefix cache is the digest of its files, folded into the first
block's hash of its requests as the cache salt is (:func:`lora_salt`), never its name or id:
two adapters called alike but with other weights, or one reloaded with new weights, can
never hit each other's blocks, and the base model's blocks are never hit by an adapter's
requests (nor the other way round).

Host memory keeps the versions running requests use and up to ``max_cpu_loras`` idle ones,
least recently used first out; an idle version dropped from it is read again from its
directory when a request asks for it, and refused if its files changed since it was loaded.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from services.common.limits import FieldError
from services.common.lora import check_lora_name as check_name
from services.common.lora import lora_salt
from services.executor.core.outputs import EngineError, RequestErrorCode
from services.executor.model.errors import ModelLoadError
from services.executor.model.lora.adapter import LoRAAdapter
from services.executor.model.lora.slots import LoRASlots

__all__ = ["NO_ADAPTERS", "AdapterVersion", "LoRARegistry", "check_lora_name", "lora_salt"]


def check_lora_name(name: str, field: str = "lora_name") -> None:
    """INVALID_ARGUMENT unless ``name`` is a usable adapter name."""
    try:
        check_name(name, field)
    except FieldError as exc:
        raise EngineError(RequestErrorCode.INVALID_ARGUMENT, str(exc)) from None


@dataclass
class AdapterVersion:
    """One loaded version of a named adapter."""

    id: int  # > 0, never reused
    name: str
    path: str
    digest: bytes
    rank: int
    num_requests: int = 0  # live requests using it
    retired: bool = False  # replaced or unloaded: no new requests; forgotten once idle


_DISABLED = "lora_name: this executor serves no adapters (start it with --enable-lora)"


class LoRARegistry:
    """The executor's adapters (see the module docstring). ``slots`` is the runner's slot
    table, which reads and checks adapters for its model and holds the versions' host
    copies. Without it (:data:`NO_ADAPTERS`) the executor serves the base model only."""

    def __init__(self, slots: LoRASlots | None = None, max_cpu_loras: int = 0) -> None:
        self.slots, self.max_cpu_loras = slots, max_cpu_loras
        if slots is not None:
            slots.reset()  # ids start over: no version of an earlier registry may linger
        self.names: dict[str, AdapterVersion] = {}
        self.versions: dict[int, AdapterVersion] = {}
        self._ids = itertools.count(1)
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle versions in host memory

    @property
    def enabled(self) -> bool:
        return self.slots is not None

    @property
    def max_loras(self) -> int:
        return 0 if self.slots is None else self.slots.num_slots

    def load(
        self,
        name: str,
        path: str,
        *,
        replace: bool = False,
        adapter: LoRAAdapter | None = None,
    ) -> AdapterVersion:
        """Serve the adapter at ``path`` as ``name`` (``adapter``: already read there, by
        :meth:`read_checked`). ALREADY_EXISTS if the name is taken and not ``replace``;
        INVALID_ARGUMENT naming the field if it cannot serve."""
        check_lora_name(name)
        if self.slots is None:
            raise EngineError(RequestErrorCode.FAILED_PRECONDITION, _DISABLED)
        if name in self.names and not replace:
            raise EngineError(
                RequestErrorCode.ALREADY_EXISTS,
                f"lora_name: {name!r} is loaded already (load it with replace to swap it)",
            )
        if adapter is None:
            adapter = self.read_checked(path)
        version = AdapterVersion(next(self._ids), name, path, adapter.digest, adapter.rank)
        self.slots.register(version.id, adapter)
        old = self.names.get(name)
        self.names[name] = self.versions[version.id] = version
        self._idle[version.id] = None
        if old is not None:
            self._retire(old)
        self._trim()
        return version

    def unload(self, name: str) -> AdapterVersion:
        """Stop serving ``name``. NOT_FOUND if unknown; FAILED_PRECONDITION while requests
        use it (nothing changes: unload it once they finish)."""
        version = self._named(name)
        if version.num_requests:
            raise EngineError(
                RequestErrorCode.FAILED_PRECONDITION,
                f"lora_name: {name!r} serves {version.num_requests} running requests; "
                "unload it once they finish",
            )
        del self.names[name]
        self._retire(version)
        return version

    def bind(self, name: str, cache_salt: bytes) -> tuple[int, bytes]:
        """A new request of adapter ``name`` (empty: the base model): its adapter id and its
        cache salt. NOT_FOUND for an unknown name; the adapter is in host memory on return
        and stays there until :meth:`release`."""
        if b"\0" in cache_salt:  # (adapters' salts start with one: none can be forged)
            raise EngineError(RequestErrorCode.INVALID_ARGUMENT, "cache_salt: holds a NUL")
        if not name:
            return 0, cache_salt
        version = self._named(name)
        assert self.slots is not None  # (a name is known)
        if version.id not in self.slots.adapters:  # dropped from host memory: read it again
            adapter = self.read_checked(version.path)
            if adapter.digest != version.digest:
                raise EngineError(
                    RequestErrorCode.FAILED_PRECONDITION,
                    f"lora_name: the files of {name!r} changed since it was loaded; "
                    "load it again to serve the new weights",
                )
            self.slots.register(version.id, adapter)
        self._idle.pop(version.id, None)
        version.num_requests += 1
        return version.id, lora_salt(cache_salt, version.digest)

    def release(self, adapter_id: int) -> None:
        """A request of ``adapter_id`` (0: the base model) ended."""
        version = self.versions.get(adapter_id)
        if version is None:
            return
        version.num_requests -= 1
        if version.num_requests:
            return
        if version.retired:
            self._forget(version)
        else:
            self._idle[version.id] = None
            self._trim()

    def _named(self, name: str) -> AdapterVersion:
        version = self.names.get(name)
        if version is None:
            hint = "" if self.enabled else " (this executor serves none: --enable-lora)"
            raise EngineError(
                RequestErrorCode.NOT_FOUND, f"lora_name: no adapter {name!r} is loaded here{hint}"
            )
        return version

    def read_checked(self, path: str) -> LoRAAdapter:
        """The adapter at ``path``, read and checked for this model (any thread);
        INVALID_ARGUMENT naming the field if it cannot serve."""
        if self.slots is None:
            raise EngineError(RequestErrorCode.FAILED_PRECONDITION, _DISABLED)
        try:
            return self.slots.read(path)
        except (ModelLoadError, OSError) as exc:
            raise EngineError(RequestErrorCode.INVALID_ARGUMENT, str(exc)) from None

    def _retire(self, version: AdapterVersion) -> None:
        version.retired = True
        if not version.num_requests:
            self._forget(version)

    def _forget(self, version: AdapterVersion) -> None:
        self.versions.pop(version.id, None)
        self._idle.pop(version.id, None)
        if self.slots is not None:
            self.slots.forget(version.id)

    def _trim(self) -> None:
        while len(self._idle) > self.max_cpu_loras and self.slots is not None:
            oldest, _ = self._idle.popitem(last=False)
            self.slots.forget(oldest)  # its host copy and slot; read again when asked for


#: The registry of an executor started without ``--enable-lora``: the base model only.
NO_ADAPTERS = LoRARegistry()
