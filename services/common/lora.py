"""What the gateway and the executor agree on about LoRA adapters (pure): the names a request
may give, and how an adapter's identity enters the prefix cache."""

from __future__ import annotations

import re

from services.common.limits import FieldError

__all__ = ["LORA_SALT_PREFIX", "MAX_LORA_NAME_LEN", "check_lora_name", "lora_salt"]

MAX_LORA_NAME_LEN = 128
_NAME = re.compile(r"[\w.:/@+-]+")
#: Starts every adapter request's salt; a client's cache_salt may hold no NUL (refused by the
#: gateway's validation and the executor's ``LoRARegistry.bind``), so none can be taken for one.
LORA_SALT_PREFIX = b"\0lora\0"


def lora_salt(cache_salt: bytes, digest: bytes) -> bytes:
    """The cache salt of a request of the adapter whose files hash to ``digest`` (sha256):
    the digest before the client's salt, in a namespace of its own. It salts the first
    block's hash, so the adapter's blocks chain apart from the base model's and from any
    other content's, whatever the adapters are called."""
    return LORA_SALT_PREFIX + digest + cache_salt


def check_lora_name(name: str, field: str = "lora_name") -> None:
    """A :class:`FieldError` unless ``name`` can name an adapter."""
    if not name or len(name) > MAX_LORA_NAME_LEN or not _NAME.fullmatch(name):
        raise FieldError(
            field,
            f"{name!r} is not an adapter name (1-{MAX_LORA_NAME_LEN} characters: letters, "
            "digits and . _ - : / @ +)",
        )
