"""Per-request generation parameters as the executor sees them (token-level only: stop strings
and detokenization belong to the gateway)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_N = 256


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

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first offending field."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
