"""Reasoning parsers: a thinking model's reasoning split from its answer, for the chat API's
``reasoning_content`` (the gateway's ``--reasoning-parser``, vLLM's names).

- ``qwen3`` (Qwen3, QwQ with ``<think>`` written by the model): a reply that opens with
  ``<think>`` reasons until ``</think>``; one that does not is all answer.
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose template opens the think block in the
  prompt): a reply reasons from its start (after an optional ``<think>``) until ``</think>``.

Text inside a think block is reasoning whether or not the block closes (a reply cut by
``max_tokens`` mid-thought is all reasoning), streamed or not alike. While a reply streams,
text that may be the start of a marker is held until the next text tells.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.text.stop_strings import holdback_len

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool  # the template opened the think block: the reply starts inside it

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) of a reply so far; unless ``finished``, both stop before text
        that may begin a marker, and each only grows as the reply does."""
        body, thinking = text, self.opens_in_prompt
        if body.startswith(START):
            body, thinking = body[len(START) :], True
        elif not finished and START.startswith(body) and body:
            return "", ""  # may still open with <think>
        if not thinking:
            return "", body
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :]
        if finished:
            return body, ""
        return body[: len(body) - holdback_len(body, (END,))], ""


PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", opens_in_prompt=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_prompt=True),
}
