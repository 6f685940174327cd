"""Validation of public requests, before anything reaches an executor.

Every refusal is a :class:`~services.common.limits.FieldError` whose message starts with the
offending field's path (``sampling_params.top_p: ...``); the servicer maps it to
INVALID_ARGUMENT. The ranges shared with the executor live in :mod:`services.common.limits`
and :class:`~services.common.sampling_params.SamplingParams`; only the gateway's own rules
(input kinds, chat roles, stop strings, cache salt) are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.v1 import executor_pb2, generation_pb2
from services.common.limits import MAX_CACHE_SALT_LEN, MAX_STOP_STRINGS, FieldError
from services.common.lora import check_lora_name
from services.common.sampling_params import (
    SamplingParams,
    params_from_message,
    params_to_message,
)

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_n: int
    max_prompt_bytes: int


def check_prompt_bytes(field: str, content: str | generation_pb2.ChatMessages, limit: int) -> None:
    """Refuse a text or chat prompt longer than ``limit`` UTF-8 bytes, before tokenizing it
    (tokenizing megabytes takes seconds and is wasted: it could never fit)."""
    if isinstance(content, str):
        size = len(content.encode())
    else:
        size = sum(_message_bytes(m) for m in content.messages)
        size += sum(len(t.encode()) for t in content.tools)
    if size > limit:
        raise FieldError(field, f"{size} bytes exceed --max-prompt-bytes={limit}")


def _message_bytes(m: generation_pb2.ChatMessage) -> int:
    """The UTF-8 bytes of every string of a chat message (a template may render any)."""
    strings = [m.role, m.content, m.tool_call_id, m.name]
    for c in m.tool_calls:
        strings += [c.id, c.name, c.arguments]
    return sum(len(s.encode()) for s in strings)


@dataclass(frozen=True)
class TextOptions:
    """What the gateway itself does with the output text."""

    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logprobs: bool


def check_input_kind(request: generation_pb2.GenerateRequest) -> str:
    """Which input the request carries; exactly one must be set and non-empty."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise FieldError("input", "exactly one of prompt, prompt_token_ids or messages is required")
    if kind == "prompt" and not request.prompt:
        raise FieldError("prompt", "must not be empty")
    if kind == "prompt_token_ids" and not request.prompt_token_ids.ids:
        raise FieldError("prompt_token_ids", "must not be empty")
    if kind == "messages":
        check_messages(request.messages, "messages")
    return kind


def check_messages(messages: generation_pb2.ChatMessages, field: str) -> None:
    if not messages.messages:
        raise FieldError(f"{field}.messages", "must not be empty")
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise FieldError(
                f"{field}.messages[{i}].role",
                f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}",
            )
        if m.tool_calls and m.role != "assistant":
            raise FieldError(
                f"{field}.messages[{i}].tool_calls", "only an assistant turn calls tools"
            )


def sampling_to_executor(
    request: generation_pb2.GenerateRequest,
    num_prompt_tokens: int,
    limits: Limits,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> tuple[executor_pb2.ExecutorSamplingParams, TextOptions]:
    """Apply defaults and the shared range rules; return the executor's params and the
    gateway's own text options. ``default_max_tokens`` None: an unset ``max_tokens`` means
    whatever room the prompt leaves in ``max_model_len`` (OpenAI chat completions)."""
    sp = request.sampling_params
    f = "sampling_params"

    def opt(name: str, default: Any) -> Any:
        """A proto3 ``optional`` field, or ``default`` when unset."""
        return getattr(sp, name) if sp.HasField(name) else default

    if default_max_tokens is None:
        default_max_tokens = max(1, limits.max_model_len - num_prompt_tokens)
    params = params_from_message(sp, max_tokens=default_max_tokens)
    try:
        params.validate(limits.vocab_size, limits.max_n)
    except FieldError as exc:
        raise exc.under(f) from None
    if num_prompt_tokens + params.max_tokens > limits.max_model_len:
        raise FieldError(
            f"{f}.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len={limits.max_model_len}",
        )
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise FieldError(f"{f}.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(sp.stop):
        if not s:
            raise FieldError(f"{f}.stop[{i}]", "stop strings must not be empty")
    if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
        raise FieldError("cache_salt", f"at most {MAX_CACHE_SALT_LEN} characters")
    if "\0" in request.cache_salt:
        raise FieldError("cache_salt", "must not hold a NUL character")
    if request.lora_name:
        check_lora_name(request.lora_name)
    options = TextOptions(
        stop=tuple(sp.stop),
        include_stop_str_in_output=opt("include_stop_str_in_output", False),
        skip_special_tokens=opt("skip_special_tokens", True),
        logprobs=params.logprobs is not None,
    )
    return params_to_pb(params), options


def params_to_pb(p: SamplingParams) -> executor_pb2.ExecutorSamplingParams:
    msg = executor_pb2.ExecutorSamplingParams()
    params_to_message(p, msg)
    return msg


def check_runner(runner: str, wanted: str) -> None:
    """The executors' ``--runner`` (``generate`` or ``pooling``; empty: generate) must be
    the one the request needs, else the field ``model`` is at fault."""
    runner = runner or "generate"
    if runner != wanted:
        what = "an embedding" if wanted == "pooling" else "a generation"
        raise FieldError(
            "model",
            f"this model is served by --runner {runner} executors; {what} needs --runner {wanted}",
        )
