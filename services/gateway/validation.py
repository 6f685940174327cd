"""Validation of public requests, before anything reaches an executor.

Every refusal is a :class:`ValidationError` whose message starts with the offending field's
path (``sampling_params.top_p: ...``); the servicer maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.v1 import executor_pb2, generation_pb2

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_CACHE_SALT_LEN = 256


class ValidationError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_n: int


@dataclass(frozen=True)
class TextOptions:
    """What the gateway itself does with the output text."""

    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logprobs: bool


def _fail(field: str, message: str) -> ValidationError:
    return ValidationError(f"{field}: {message}")


def check_input_kind(request: generation_pb2.GenerateRequest) -> str:
    """Which input the request carries; exactly one must be set and non-empty."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise _fail("input", "exactly one of prompt, prompt_token_ids or messages is required")
    if kind == "prompt" and not request.prompt:
        raise _fail("prompt", "must not be empty")
    if kind == "prompt_token_ids" and not request.prompt_token_ids.ids:
        raise _fail("prompt_token_ids", "must not be empty")
    if kind == "messages":
        check_messages(request.messages, "messages")
    return kind


def check_messages(messages: generation_pb2.ChatMessages, field: str) -> None:
    if not messages.messages:
        raise _fail(f"{field}.messages", "must not be empty")
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise _fail(f"{field}.messages[{i}].role",
                        f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}")  # fmt: skip


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise _fail("request_id", f"at most {MAX_REQUEST_ID_LEN} characters")


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise _fail(f"{field}[{i}]",
                        f"token id {t} is outside the vocabulary [0, {vocab_size})")  # fmt: skip


def sampling_to_executor(
    request: generation_pb2.GenerateRequest, num_prompt_tokens: int, limits: Limits
) -> tuple[executor_pb2.ExecutorSamplingParams, TextOptions]:
    """Apply defaults and range checks; return the executor's params and the gateway's own."""
    sp = request.sampling_params
    f = "sampling_params"

    def opt(name: str, default: Any) -> Any:
        """A proto3 ``optional`` field, or ``default`` when unset."""
        return getattr(sp, name) if sp.HasField(name) else default

    max_tokens = opt("max_tokens", 16)
    if max_tokens < 1:
        raise _fail(f"{f}.max_tokens", "must be >= 1")
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        raise _fail(
            f"{f}.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len={limits.max_model_len}",
        )
    min_tokens = opt("min_tokens", 0)
    if min_tokens > max_tokens:
        raise _fail(f"{f}.min_tokens", f"must be <= max_tokens ({max_tokens})")
    temperature = opt("temperature", 1.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise _fail(f"{f}.temperature", f"must be finite and >= 0, got {temperature}")
    top_p = opt("top_p", 1.0)
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise _fail(f"{f}.top_p", f"must be in (0, 1], got {top_p}")
    top_k = opt("top_k", -1)
    if top_k < -1:
        raise _fail(f"{f}.top_k", f"must be -1 (disabled) or >= 0, got {top_k}")
    min_p = opt("min_p", 0.0)
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise _fail(f"{f}.min_p", f"must be in [0, 1], got {min_p}")
    n = opt("n", 1)
    if not 1 <= n <= limits.max_n:
        raise _fail(f"{f}.n", f"must be in [1, {limits.max_n}], got {n}")
    rep = opt("repetition_penalty", 1.0)
    if not (math.isfinite(rep) and 0 < rep <= 10):
        raise _fail(f"{f}.repetition_penalty", f"must be in (0, 10], got {rep}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = opt(name, 0.0)
        if not (math.isfinite(v) and -2 <= v <= 2):
            raise _fail(f"{f}.{name}", f"must be in [-2, 2], got {v}")
    logprobs = opt("logprobs", None)
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise _fail(f"{f}.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise _fail(f"{f}.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(sp.stop):
        if not s:
            raise _fail(f"{f}.stop[{i}]", "stop strings must not be empty")
    check_token_ids(list(sp.stop_token_ids), limits.vocab_size, f"{f}.stop_token_ids")
    if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
        raise _fail("cache_salt", f"at most {MAX_CACHE_SALT_LEN} characters")

    params = executor_pb2.ExecutorSamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=opt("ignore_eos", False),
        repetition_penalty=rep,
        presence_penalty=opt("presence_penalty", 0.0),
        frequency_penalty=opt("frequency_penalty", 0.0),
    )
    if sp.HasField("seed"):
        params.seed = sp.seed
    if logprobs is not None:
        params.logprobs = logprobs
    options = TextOptions(
        stop=tuple(sp.stop),
        include_stop_str_in_output=opt("include_stop_str_in_output", False),
        skip_special_tokens=opt("skip_special_tokens", True),
        logprobs=logprobs is not None,
    )
    return params, options
