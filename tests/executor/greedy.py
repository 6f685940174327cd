"""A minimal greedy decoding loop over ``ModelRunner`` (a stand-in for the scheduler), and
the transformers reference it is compared with.

Blocks are handed out by hand from a shuffled free list, so sequences own scattered,
non-contiguous physical blocks, as they do under a real block manager.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from services.executor.core.sequence import RequestKey
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.runner import ModelRunner

PROMPT_TEXTS = (
    "The train",
    "A good cup of tea needs only three things: fresh water, a warm pot",
    "How does a server answer many requests at once? It keeps a queue of work and a pool of "
    "workers. Each worker takes the next task, finishes it, and returns for another one.",
    "Café crème, 日本語 and 🙂 are all bytes",
)
_MAX_STEPS = 10_000


class BlockAllocator:
    """Hands out block ids 1..num_blocks-1 (block 0 is reserved) in a seeded random order."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = random.Random(seed).sample(range(1, num_blocks), num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of blocks: want {n}, have {len(self.free)}")
        taken, self.free = self.free[:n], self.free[n:]
        return taken


@dataclass
class GreedySeq:
    """One sequence of the loop. ``block_table``/``num_computed_tokens`` may be preset to
    start from cached blocks; ``start_step`` delays its arrival.
    """

    prompt: list[int]
    max_new_tokens: int
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    start_step: int = 0
    output: list[int] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)  # [V] per generated token
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def run_greedy(
    runner: ModelRunner,
    seqs: Sequence[GreedySeq],
    *,
    allocator: BlockAllocator,
    chunk_size: int | None = None,
    num_steps: int | None = None,
) -> None:
    """Step all ``seqs`` together until each has ``max_new_tokens`` tokens or emitted EOS
    (or, if given, for exactly ``num_steps`` steps).

    Every step batches each live sequence's next piece: a prefill chunk of at most
    ``chunk_size`` prompt tokens (whole prompt if None), or its last sampled token.
    """
    eos = set(runner.config.eos_token_ids)
    block_size = runner.block_size
    for step in range(num_steps if num_steps is not None else _MAX_STEPS):
        live = [s for s in seqs if not s.finished and step >= s.start_step]
        if all(s.finished for s in seqs):
            return
        chunks = []
        for s in live:
            tokens = s.tokens
            if s.num_computed_tokens < len(s.prompt) and chunk_size is not None:
                end = min(len(s.prompt), s.num_computed_tokens + chunk_size)
            else:
                end = len(tokens)
            num_missing = -(-end // block_size) - len(s.block_table)
            if num_missing > 0:
                s.block_table += allocator.allocate(num_missing)
            chunks.append(
                SeqChunk(
                    token_ids=tokens[s.num_computed_tokens : end],
                    num_computed_tokens=s.num_computed_tokens,
                    block_table=list(s.block_table),
                    need_logits=end == len(tokens),
                )
            )
        if not chunks:
            continue
        logits = runner.execute(chunks)
        rows = iter(logits)
        for s, chunk in zip(live, chunks, strict=True):
            s.num_computed_tokens += len(chunk.token_ids)
            if chunk.need_logits:
                row = next(rows)
                s.logits.append(row.clone())  # a graph replay reuses its output buffer
                s.output.append(int(row.argmax()))
                s.finished = s.output[-1] in eos or len(s.output) == s.max_new_tokens
        assert next(rows, None) is None, "more logits rows than chunks needing them"
    if num_steps is None:
        raise AssertionError(f"not finished after {_MAX_STEPS} steps")


def greedy_alone(
    runner: ModelRunner, prompt: list[int], max_new_tokens: int, **kwargs: object
) -> GreedySeq:
    """Greedy-decode one prompt on its own; returns the finished sequence."""
    seq = GreedySeq(prompt, max_new_tokens)
    run_greedy(runner, [seq], allocator=BlockAllocator(runner.num_blocks), **kwargs)  # type: ignore[arg-type]
    return seq


@torch.inference_mode()
def hf_greedy(
    model: PreTrainedModel, prompt: list[int], max_new_tokens: int, **generate_kwargs: Any
) -> tuple[list[int], list[Tensor]]:
    """transformers' greedy ``generate`` (with ``generate_kwargs``, e.g. ``sequence_bias``):
    the new tokens and the raw logits of each step."""
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **generate_kwargs,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


@torch.inference_mode()
def hf_beams(
    model: PreTrainedModel,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    *,
    ends: Sequence[int] = (),
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[list[int]]:
    """transformers' beam search (``num_beams = num_return_sequences = k``, greedy): the
    beams' new tokens, best first. ``ends``: the end tokens (none: no end token at all, as
    ``ignore_eos``; an id past the vocabulary stands for it, since transformers would fall
    back to the model's EOS). A beam that ended early is padded by transformers."""
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = sorted(ends) or [model.config.vocab_size + 1]
    gc.pad_token_id = model.config.pad_token_id
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=gc,
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    return [row[len(prompt) :].tolist() for row in out]


def run_engine(engine: Any, requests: dict[str, tuple[Any, ...]]) -> tuple[dict, dict]:
    """Add ``requests`` (``id -> (prompt, params[, resume])``) to the engine and step it to
    the end: the tokens and the final output of each ``(id, sample index)``."""
    for rid, (prompt, params, *resume) in requests.items():
        engine.add_request(RequestKey(0, rid), prompt, params, resume=resume[0] if resume else None)
    tokens: dict[tuple[str, int], list[int]] = {}
    finals = {}
    while engine.has_work:
        for o in engine.step():
            key = (o.req_id.request_id, o.index)
            tokens.setdefault(key, []).extend(o.token_ids)
            if o.finish_reason is not None:
                finals[key] = o
    return tokens, finals


def shared_prefix_workload(
    model: PreTrainedModel,
    *,
    seed: int,
    num_requests: int,
    prefix_len: int,
    max_tail: int,
    max_tokens: tuple[int, int],
) -> list[tuple[list[int], int, list[int]]]:
    """``(prompt, max_tokens, transformers' greedy output)`` per request; the odd ones share a
    ``prefix_len``-token prefix (BOS included), every prompt ends in a random tail of
    ``1 .. max_tail - 1`` tokens, ``max_tokens`` is drawn from ``range(*max_tokens)``."""
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 600) for _ in range(prefix_len - 1)]
    out = []
    for i in range(num_requests):
        tail = [rng.randrange(3, 600) for _ in range(rng.randrange(1, max_tail))]
        prompt = [*shared, *tail] if i % 2 else [1, *tail]
        n = rng.randrange(*max_tokens)
        out.append((prompt, n, hf_greedy(model, prompt, n)[0]))
    return out
