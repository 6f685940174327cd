"""Per-request generation parameters at token level, and their one set of range rules.

The gateway builds a :class:`SamplingParams` from a public request (applying defaults) and the
executor builds one from its proto; both call :meth:`SamplingParams.validate`, so a range is
written once. Both protos are read and written by walking the dataclass's fields
(:func:`params_from_message`, :func:`params_to_message`), so a field and its default are
written once too; a test checks that each proto carries every field. Stop strings and
detokenization are the gateway's alone and live there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from services.common.limits import (
    MAX_KV_PIN_TTL_S,
    MAX_KV_RETENTION_PRIORITY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    FieldError,
    check_token_ids,
)
from services.common.structured_outputs import StructuredOutputs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-k alternatives returned with each chosen token
    # Log-probabilities of the prompt's tokens (each from the logits of the one before it),
    # with this many top alternatives: every prompt token is computed (no prefix-cache hit).
    prompt_logprobs: int | None = None
    # The output follows a JSON schema, regex, choice or grammar (the executor compiles it).
    structured_outputs: StructuredOutputs | None = field(
        default=None, metadata={"message": StructuredOutputs}
    )
    # Beam search of width n, as transformers' generate(num_beams=n, do_sample=False).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: str = "false"  # "false" (transformers' heuristic), "true" or "never"
    # A hint to keep the prefix cached longer: the block manager's retention priority 0..3.
    kv_retention_priority: int = 0
    # A session pin: seconds the request's blocks are kept once it ends (the next turn of an
    # agent session hits them), within the pool's pin budget; 0: none.
    kv_pin_ttl_s: float = 0.0
    # (token id, bias) pairs, by token id: the bias is added to that token's logit before
    # sampling (OpenAI's logit_bias); log-probabilities are returned without it.
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata={"map": True})
    # Derived: no penalty reads the token history, no token is ever banned (min_tokens is
    # 0) or biased, and no grammar constrains it, so a row of these params needs nothing but
    # the params themselves.
    stateless: bool = field(init=False, repr=False, compare=False)
    # Derived: stateless, unseeded and one sample: a row needs nothing but the params and
    # never forks (the sampler's and the engine's fast path).
    plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stateless = (
            not self.has_penalties
            and self.min_tokens == 0
            and self.structured_outputs is None
            and not self.logit_bias
        )
        object.__setattr__(self, "stateless", stateless)
        plain = stateless and self.seed is None and self.n == 1 and not self.use_beam_search
        object.__setattr__(self, "plain", plain)

    def ending_token_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end a sample: ``stop_token_ids``, and the model's EOS ids unless
        ``ignore_eos``."""
        stops = frozenset(self.stop_token_ids)
        return stops if self.ignore_eos else stops | eos_token_ids

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
        )

    def validate(self, vocab_size: int, max_n: int = MAX_N) -> None:
        """Raise :class:`FieldError` naming the first offending field."""
        if not 1 <= self.n <= max_n:
            raise FieldError("n", f"must be in [1, {max_n}], got {self.n}")
        if self.max_tokens < 1:
            raise FieldError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise FieldError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise FieldError("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise FieldError("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise FieldError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise FieldError(
                "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise FieldError(name, f"must be in [-2, 2], got {v}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise FieldError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise FieldError(
                "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise FieldError("seed", f"must be in [0, 2^63), got {self.seed}")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
            if self.min_tokens:  # the grammar's end and the ban on ending would collide
                raise FieldError("min_tokens", "must be 0 with structured_outputs")
        if self.early_stopping not in EARLY_STOPPING:
            raise FieldError(
                "early_stopping",
                f"must be one of {', '.join(EARLY_STOPPING)}, got {self.early_stopping!r}",
            )
        if not math.isfinite(self.length_penalty):
            raise FieldError("length_penalty", "must be finite")
        if not 0 <= self.kv_retention_priority <= MAX_KV_RETENTION_PRIORITY:
            raise FieldError(
                "kv_retention_priority",
                f"must be in [0, {MAX_KV_RETENTION_PRIORITY}], got {self.kv_retention_priority}",
            )
        if not 0 <= self.kv_pin_ttl_s <= MAX_KV_PIN_TTL_S:  # (NaN is refused too)
            raise FieldError(
                "kv_pin_ttl_s",
                f"must be in [0, {MAX_KV_PIN_TTL_S:g}] seconds, got {self.kv_pin_ttl_s}",
            )
        self._check_logit_bias(vocab_size)
        if self.use_beam_search:
            self._check_beam_search()

    def _check_logit_bias(self, vocab_size: int) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise FieldError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        if len({token for token, _ in self.logit_bias}) < len(self.logit_bias):
            raise FieldError("logit_bias", "names a token twice")
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise FieldError(
                    f"logit_bias[{token}]", f"token id is outside the vocabulary [0, {vocab_size})"
                )
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise FieldError(f"logit_bias[{token}]", f"must be in [-100, 100], got {bias}")

    def _check_beam_search(self) -> None:
        conflicts = {
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
            "logit_bias": bool(self.logit_bias),
        }
        for name, conflict in conflicts.items():
            if conflict:
                raise FieldError(name, "is not supported with use_beam_search")


EARLY_STOPPING = ("false", "true", "never")

#: The fields a request sets, in declaration order (the derived ones are left out).
PARAM_FIELDS: tuple[dataclasses.Field[Any], ...] = tuple(
    f for f in dataclasses.fields(SamplingParams) if f.init
)


def params_from_message(msg: Message, **defaults: Any) -> SamplingParams:
    """The :class:`SamplingParams` a proto message carries. The message must have a field of
    the same name for each of :data:`PARAM_FIELDS`. A field with presence (proto3
    ``optional``, or a message) that is unset takes ``defaults[name]`` if given, else the
    dataclass's default; a repeated field becomes a tuple; a message field, the type its
    dataclass field names in ``metadata["message"]`` (``from_message``); a map
    field (``metadata["map"]``), its (key, value) pairs sorted by key."""
    values = dict(defaults)
    by_name = msg.DESCRIPTOR.fields_by_name
    for f in PARAM_FIELDS:
        desc = by_name[f.name]
        if "message" in f.metadata:
            if msg.HasField(f.name):
                values[f.name] = f.metadata["message"].from_message(getattr(msg, f.name))
        elif "map" in f.metadata:
            values[f.name] = tuple(sorted(getattr(msg, f.name).items()))
        elif _is_repeated(desc):
            values[f.name] = tuple(getattr(msg, f.name))
        elif not desc.has_presence or msg.HasField(f.name):
            values[f.name] = getattr(msg, f.name)
    return SamplingParams(**values)


def params_to_message(params: SamplingParams, msg: Message) -> Message:
    """Write ``params`` into ``msg`` (returned): every field, a None leaving an optional one
    unset."""
    for f in PARAM_FIELDS:
        value = getattr(params, f.name)
        if value is None:
            msg.ClearField(f.name)
        elif "message" in f.metadata:
            value.to_message(getattr(msg, f.name))
        elif "map" in f.metadata:
            entries = getattr(msg, f.name)
            entries.clear()
            entries.update(value)
        elif isinstance(value, tuple):
            getattr(msg, f.name)[:] = value
        else:
            setattr(msg, f.name, value)
    return msg


def _is_repeated(desc: Any) -> bool:
    # protobuf >= 5.28 has ``is_repeated``; ``label`` is gone from newer upb builds.
    flag = getattr(desc, "is_repeated", None)
    return bool(flag) if flag is not None else desc.label == desc.LABEL_REPEATED
