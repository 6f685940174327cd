"""What the generation core is configured with: the part of the gateway's configuration it
reads (the CLI's :class:`~services.gateway.service.config.GatewayConfig` builds it)."""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_BYTES_PER_TOKEN = 32  # more UTF-8 bytes per token than any real text needs


@dataclass(frozen=True)
class GenerationSettings:
    """``model_name``: the name clients address the model by. Admission: up to
    ``max_concurrent_requests`` sent to the executors at once, ``max_queued_requests`` more
    waiting in the gateway. ``max_prompt_bytes``: the largest prompt accepted (None:
    :data:`PROMPT_BYTES_PER_TOKEN` x the executor's max_model_len). ``executor_wait_s``: how
    long a stream waits for a serving executor; ``max_resumes``: how often a stream whose
    executor is lost is carried on elsewhere."""

    model_name: str
    max_concurrent_requests: int = 1024
    max_queued_requests: int = 4096
    max_n: int = 16
    max_prompt_bytes: int | None = None
    tokenizer_workers: int = 2
    executor_wait_s: float = 30.0
    max_resumes: int = 2
