"""The request rules that both the gateway and the executor enforce, in one place (pure: no
grpc, no torch).

Every check raises :class:`FieldError`, a ``ValueError`` whose message starts with the path of
the offending field (``prompt_token_ids[3]: ...``); each service prefixes its own path
(``sampling_params.``) and maps the error to INVALID_ARGUMENT at its edge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_REQUEST_ID_LEN = 256
MAX_LOGPROBS = 20  # top-k alternatives returned with each chosen token
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_KV_RETENTION_PRIORITY = 3  # the highest retention priority a request may give its prefix
MAX_KV_PIN_TTL_S = 86_400.0  # the longest session pin a request may ask (a day)
MAX_N = 256  # parallel samples one executor accepts per request (a gateway may cap lower)
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_LEN = 256


class FieldError(ValueError):
    """A value outside its allowed range; ``str(exc)`` is ``"<field>: <what is wrong>"``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

    def under(self, prefix: str) -> FieldError:
        """The same error, with its field path below ``prefix`` (``sampling_params``)."""
        return FieldError(f"{prefix}.{self.field}", str(self).split(": ", 1)[1])


def field_of(message: str) -> str | None:
    """The field a :class:`FieldError`'s message names (``"field: why"``), if it does."""
    head, sep, _ = message.partition(": ")
    return head if sep and re.fullmatch(r"[\w.\[\]]+", head) else None


def check_request_id(request_id: str) -> None:
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_LEN:
        raise FieldError("request_id", f"must be 1..{MAX_REQUEST_ID_LEN} characters")


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise FieldError(
                f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})"
            )


def check_prompt(ids: Sequence[int], vocab_size: int, max_model_len: int, field: str) -> None:
    """A prompt must be non-empty, in the vocabulary, and leave room for one output token."""
    if not ids:
        raise FieldError(field, "must not be empty")
    if len(ids) >= max_model_len:
        raise FieldError(
            field,
            f"{len(ids)} tokens leave no room to generate within max_model_len={max_model_len}",
        )
    check_token_ids(ids, vocab_size, field)
