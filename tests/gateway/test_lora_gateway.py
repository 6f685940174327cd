"""The gateway's side of multi-LoRA, in process: request rules, runtime updates off unless
enabled, and prefix-aware routing that hashes a prompt as each executor salts it (the
adapter's digest before the client's salt), so that an adapter's prompt never matches the
base model's cached blocks, nor another version's."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.v1 import generation_pb2
from services.blockmgr.api.hashing import block_hashes
from services.common.limits import FieldError
from services.common.lora import lora_salt
from services.gateway.core.adapters import AdapterService
from services.gateway.core.generation import ErrorKind, GenerationError
from services.gateway.core.validation import Limits, sampling_to_executor
from services.gateway.fleet.executor_client import ExecutorPool
from services.gateway.fleet.prefix_index import PrefixIndex
from services.gateway.fleet.routing import Candidate, Router, RoutingPolicy

LIMITS = Limits(max_model_len=256, vocab_size=600, max_n=4, max_prompt_bytes=10_000)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"cache_salt": "tenant\0lora"}, "cache_salt"),
        ({"lora_name": "has space"}, "lora_name"),
        ({"lora_name": "x" * 129}, "lora_name"),
    ],
)
def test_a_nul_in_the_salt_or_a_malformed_adapter_name_is_refused_naming_it(
    fields: dict[str, str], field: str
) -> None:
    request = generation_pb2.GenerateRequest(prompt="hi", **fields)
    with pytest.raises(FieldError) as err:
        sampling_to_executor(request, 3, LIMITS)
    assert err.value.field == field


def test_runtime_adapter_updates_are_permission_denied_unless_enabled() -> None:
    async def attempt(allow: bool, name: str) -> GenerationError:
        service = AdapterService(ExecutorPool(()), allow_runtime_updates=allow)
        with pytest.raises(GenerationError) as err:
            await service.load(name, "/adapters/x")
        with pytest.raises(GenerationError) as unload:
            await service.unload(name)
        assert unload.value.kind in (ErrorKind.PERMISSION_DENIED, ErrorKind.NOT_FOUND)
        return err.value

    denied = asyncio.run(attempt(False, "x"))
    assert denied.kind is ErrorKind.PERMISSION_DENIED
    assert "--allow-runtime-lora-updating" in denied.message
    bad = asyncio.run(attempt(True, "bad name"))
    assert (bad.kind, bad.field) == (ErrorKind.INVALID_ARGUMENT, "lora_name")
    none = asyncio.run(attempt(True, "x"))
    assert none.kind is ErrorKind.UNAVAILABLE  # no executor to load it on


def test_prefix_aware_routing_matches_an_adapter_prompt_only_under_its_own_salt() -> None:
    index = PrefixIndex()
    for pool in ("p0", "p1"):
        index.set_synced(pool, True)
    router = Router(RoutingPolicy.PREFIX_AWARE, index, load_weight=0.0)
    prompt = list(range(1, 66))
    digest_a, digest_b = b"a" * 32, b"b" * 32

    def candidates(digest: bytes | None) -> list[Candidate]:
        salt = None if digest is None else lora_salt(b"", digest)
        return [Candidate(p, p, 16, True, 0, salt) for p in ("p0", "p1")]

    first = router.choose(candidates(digest_a), prompt)
    chosen = ("p0", "p1")[first.index]
    salted = block_hashes(prompt, 16, lora_salt(b"", digest_a))[:4]
    assert index.match(chosen, salted) == 4  # noted under the adapter's salt
    assert index.match(chosen, block_hashes(prompt, 16)[:4]) == 0  # not the base model's
    again = router.choose(candidates(digest_a), prompt)
    assert (again.index, again.predicted_cached_tokens) == (first.index, 64)
    assert router.choose(candidates(digest_b), prompt).predicted_cached_tokens == 0
    assert router.choose(candidates(None), prompt).predicted_cached_tokens == 0
