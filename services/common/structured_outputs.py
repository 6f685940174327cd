"""What a request's structured output must follow: a JSON schema, any JSON object, a regex,
one of a list of strings, or an EBNF grammar. Checked here for what needs no grammar
compiler (sizes, emptiness, JSON syntax); the executor compiles it (xgrammar) and refuses
what does not compile, naming the same field."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from google.protobuf.message import Message

from services.common.limits import FieldError

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar
MAX_CHOICES = 256


class StructuredKind(enum.StrEnum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One constraint; hashable, so compiled grammars are cached by it. ``spec`` is the JSON
    schema, regex or grammar text (empty for ``json_object`` and ``choice``)."""

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field it came from, relative to the sampling params."""
        return f"structured_outputs.{self.kind.value}"

    def validate(self) -> None:
        """Raise :class:`FieldError` naming the field (``structured_outputs.<kind>``)."""
        if self.kind is StructuredKind.CHOICE:
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise FieldError(self.field, f"must list 1..{MAX_CHOICES} strings")
            for i, choice in enumerate(self.choices):
                if not choice:
                    raise FieldError(f"{self.field}[{i}]", "must not be empty")
            size = sum(len(c.encode()) for c in self.choices)
        elif self.kind is StructuredKind.JSON_OBJECT:
            return
        else:
            if not self.spec:
                raise FieldError(self.field, "must not be empty")
            size = len(self.spec.encode())
        if size > MAX_SPEC_BYTES:
            raise FieldError(self.field, f"{size} bytes exceed {MAX_SPEC_BYTES}")
        if self.kind is StructuredKind.JSON:
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise FieldError(self.field, f"is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise FieldError(self.field, "a JSON schema is an object (or true / false)")

    @classmethod
    def from_message(cls, msg: Message) -> StructuredOutputs | None:
        """From a ``StructuredOutputs`` proto message; None when no kind is set."""
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls(StructuredKind.CHOICE, choices=tuple(msg.choice.choices))  # type: ignore[attr-defined]
        if kind == "json_object":
            if not msg.json_object:  # type: ignore[attr-defined]
                return None
            return cls(StructuredKind.JSON_OBJECT)
        return cls(StructuredKind(kind), spec=getattr(msg, kind))

    def to_message(self, msg: Message) -> None:
        """Write into a ``StructuredOutputs`` proto message."""
        msg.Clear()
        if self.kind is StructuredKind.CHOICE:
            msg.choice.choices[:] = self.choices  # type: ignore[attr-defined]
        elif self.kind is StructuredKind.JSON_OBJECT:
            msg.json_object = True  # type: ignore[attr-defined]
        else:
            setattr(msg, self.kind.value, self.spec)
