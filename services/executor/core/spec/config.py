"""``--speculative-config``: vLLM's JSON (``method``, ``model``, ``num_speculative_tokens``,
``prompt_lookup_min``, ``prompt_lookup_max``, ``draft_tensor_parallel_size``,
``disable_by_batch_size``), checked at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common.sampling_params import SamplingParams

__all__ = ["METHODS", "SpeculativeConfig", "speculable"]

METHODS = ("ngram", "draft_model", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many tokens to draft per sequence per step, and how: ``ngram`` (prompt lookup,
    ``prompt_lookup_min/max``), ``draft_model`` (``model``: a smaller checkpoint of the
    same vocabulary, run on the first rank: ``draft_tensor_parallel_size`` 1) or ``eagle3``
    (``model``: an EAGLE-3 head for the target, on the first rank too). Without a
    ``method``, a ``model`` means ``draft_model`` (as in vLLM). ``disable_by_batch_size``: no
    drafts in a step whose batch has this many running sequences or more (0: never off),
    where verifying costs more than it saves."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: int = 0
    model: str | None = None
    draft_tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method: {self.method!r} is not served (choose one of "
                f"{', '.join(METHODS)})"
            )
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(
                f"speculative_config.model: {self.method} needs the "
                f"{'draft checkpoint' if self.method == 'draft_model' else 'EAGLE-3 head'}"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError(
                "speculative_config.model: the ngram method drafts from the prompt and takes "
                'no model (for a draft model: "method": "draft_model")'
            )
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(
                "speculative_config.draft_tensor_parallel_size: only 1 is served (the draft "
                "model runs on the first rank)"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 0:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 0")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON; ValueError naming the field on anything else."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            names = ", ".join(sorted(known))
            raise ValueError(f"speculative_config.{unknown[0]}: unknown field (known: {names})")
        if "model" in raw and "method" not in raw:
            raw["method"] = "draft_model"
        for name, value in raw.items():
            expected = str if name in ("method", "model") else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"speculative_config.{name} must be a {expected.__name__}")
        return cls(**raw)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def uses_eagle(self) -> bool:
        return self.method == "eagle3"

    @property
    def has_draft_cache(self) -> bool:
        """Drafts from a model with its own KV cache over the target's blocks, which reads a
        full-attention KV-cache group's tables."""
        return self.method in ("draft_model", "eagle3")


def speculable(params: SamplingParams) -> bool:
    """Whether a sample's drafts can be verified: any sampling (greedy, temperature, top-k/p,
    penalties, bias, seeds, log-probabilities, structured outputs), but not beam search (beams
    re-fork every step: they run unspeculated, with the same outputs)."""
    return not params.use_beam_search
