"""A trained fixture for speculative-decoding benchmarks: tiny Llamas that have learnt to copy.

A random checkpoint (:mod:`.models`) predicts nothing, so a draft model or a prompt-lookup
draft is accepted by chance alone. These are trained instead, on the CPU in a few minutes, on
synthetic sequences whose later part repeats spans (4-16 tokens) of their earlier part, so
they learn induction heads: given ``... a b ... a`` they predict ``b``. :func:`copy_prompts`
then gives prompts that invite copying (a passage and the start of its repeat), on which the
target's greedy continuation is the passage again, and both a trained draft and prompt lookup
get accepted. A benchmark fixture, not a product model: checkpoints are written by
:func:`~pagedserve.tools.tiny_model.write_tiny_model` (the tiny tokenizer, 621 ids) and their
weights replaced by the trained ones.

``python -m bench.common.trained --out DIR`` writes ``DIR/target`` and ``DIR/draft``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.tools.tiny_tokenizer import BOS, EOS, PAD, ROLE_TOKENS, build_tokenizer

__all__ = [
    "DRAFT",
    "TARGET",
    "copy_accuracy",
    "copy_corpus",
    "copy_prompts",
    "ordinary_vocab",
    "train_copy_model",
    "write_spec_fixture",
]

MARKER = "copy_fixture.json"  # written last: a finished checkpoint, its seed and settings
_FORMAT = 1  # bump when the corpus or the training loop changes (stale caches retrain)
_HELDOUT_SEED = 1_000_003  # held-out sequences: copy_corpus(seed + this, ...)
_COPY_PROB = 0.85  # per segment: copy a span, else 1-4 fresh tokens

#: The target and draft sizes of :func:`write_spec_fixture` (:func:`train_copy_model` keywords).
TARGET: dict[str, int] = {
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
}
DRAFT: dict[str, int] = {
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
}


@functools.cache
def _special_ids() -> frozenset[int]:
    tokenizer = build_tokenizer()
    ids = (tokenizer.token_to_id(tok) for tok in (BOS, EOS, PAD, *ROLE_TOKENS))
    return frozenset(i for i in ids if i is not None)


@functools.cache
def _bos_id() -> int:
    bos = build_tokenizer().token_to_id(BOS)
    assert bos is not None
    return int(bos)


def ordinary_vocab() -> range:
    """The tiny tokenizer's ordinary ids: past its special tokens (pad, bos, eos, roles)."""
    return range(max(_special_ids()) + 1, build_tokenizer().get_vocab_size())


def _copy_sequence(
    rng: random.Random, length: int, tokens: list[int]
) -> tuple[list[int], list[bool]]:
    """One sequence, and per token whether it is predictable by copying (a copied span's
    second token on: its first one starts the span at random)."""
    ids = [rng.choice(tokens) for _ in range(rng.randint(length // 4, length // 2))]
    copied = [False] * len(ids)
    while len(ids) < length:
        if rng.random() < _COPY_PROB:
            span = rng.randint(4, 16)
            start = rng.randrange(max(1, len(ids) - span + 1))
            piece = ids[start : start + span]
            ids += piece
            copied += [False] + [True] * (len(piece) - 1)
        else:
            fresh = rng.randint(1, 4)
            ids += [rng.choice(tokens) for _ in range(fresh)]
            copied += [False] * fresh
    return ids[:length], copied[:length]


def _corpus(
    seed: int, num_sequences: int, length: int, vocab: range
) -> list[tuple[list[int], list[bool]]]:
    tokens = [t for t in vocab if t not in _special_ids()]
    if not tokens:
        raise ValueError(f"no ordinary token ids in {vocab}")
    rng = random.Random(seed)
    return [_copy_sequence(rng, length, tokens) for _ in range(num_sequences)]


def copy_corpus(seed: int, num_sequences: int, length: int, vocab: range) -> list[list[int]]:
    """``num_sequences`` sequences of ``length`` ids from ``vocab`` (special ids left out),
    the same for a given seed: a random start (a quarter to half of the length), then segments
    that each copy, with probability 0.85, a span of 4-16 tokens from earlier in the same
    sequence, or else add 1-4 fresh random tokens. No BOS: the trainer prepends it."""
    return [ids for ids, _ in _corpus(seed, num_sequences, length, vocab)]


def copy_prompts(seed: int, num: int, prompt_len: int, vocab: range) -> list[list[int]]:
    """``num`` prompts of ``prompt_len`` ids (BOS first, like the benchmarks' other prompts):
    a random passage, then the first eighth of it (at least 4 tokens) again. A copying model
    continues with the rest of the passage, then the passage from its start again, and so on,
    so that drafts (a draft model's, or prompt lookup's) get accepted."""
    tokens = [t for t in vocab if t not in _special_ids()]
    repeat = max(4, (prompt_len - 1) // 8)
    passage_len = prompt_len - 1 - repeat
    if passage_len < repeat:
        raise ValueError(f"prompt_len {prompt_len} is too short to repeat a passage")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        passage = [rng.choice(tokens) for _ in range(passage_len)]
        prompts.append([_bos_id(), *passage, *passage[:repeat]])
    return prompts


def _batch(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[_bos_id(), *row] for row in rows], dtype=torch.long)


@torch.no_grad()
def copy_accuracy(model: torch.nn.Module, seed: int, num: int = 64, length: int = 255) -> float:
    """Greedy copy accuracy of ``model`` on ``num`` held-out sequences (corpus seed ``seed`` +
    a fixed offset, so not trained on): the fraction of copied-span tokens (past a span's
    first) that the argmax at the previous position predicts."""
    model.eval()
    held = _corpus(seed + _HELDOUT_SEED, num, length, ordinary_vocab())
    hits = total = 0
    for i in range(0, num, 16):
        chunk = held[i : i + 16]
        ids = _batch([row for row, _ in chunk])
        mask = torch.tensor([[False, *copied] for _, copied in chunk])
        predicted = model(input_ids=ids).logits.argmax(-1)
        right = predicted[:, :-1] == ids[:, 1:]
        hits += int(right[mask[:, 1:]].sum())
        total += int(mask[:, 1:].sum())
    return hits / total


def train_copy_model(
    directory: Path,
    *,
    seed: int = 0,
    steps: int = 400,
    batch_size: int = 16,
    lr: float = 3e-3,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_len: int = 256,
) -> Path:
    """Write a Llama checkpoint to ``directory`` and train it to copy; returns the directory.

    ``write_tiny_model`` gives the directory (config, tokenizer, init weights at std 0.02);
    AdamW (fp32, warmup then cosine decay, gradient clipping at 1) trains it on
    ``steps * batch_size`` :func:`copy_corpus` sequences of ``max_len`` tokens (BOS
    included; the model has positions for ``max(2048, max_len)`` but copies reliably only
    within ``max_len``), on the caller's torch threads, after ``torch.manual_seed(seed)``;
    the weights are saved (safetensors) and reloaded as a check, and :data:`MARKER` records
    the settings, the training time and :func:`copy_accuracy`.

    Measured with the defaults (the fixture's target: 2.7 M parameters), 2 threads on this
    2-core machine: TODO s, held-out copy accuracy TODO. The draft (:data:`DRAFT`): TODO s,
    accuracy TODO.
    """
    settings: dict[str, Any] = {
        "format": _FORMAT,
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_len": max_len,
    }
    directory = Path(directory)
    (directory / MARKER).unlink(missing_ok=True)
    write_tiny_model(
        directory,
        arch="llama",
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max(2048, max_len),
        init_std=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    corpus = copy_corpus(seed, steps * batch_size, max_len - 1, ordinary_vocab())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))),
    )
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        ids = _batch(corpus[step * batch_size : (step + 1) * batch_size])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    seconds = time.perf_counter() - start
    model.save_pretrained(directory, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    accuracy = copy_accuracy(reloaded, seed)
    record = {"settings": settings, "train_seconds": round(seconds, 1), "accuracy": accuracy}
    (directory / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return directory


def read_marker(directory: Path) -> dict[str, Any] | None:
    """What :data:`MARKER` in ``directory`` records (None if there is none: not finished)."""
    try:
        record: dict[str, Any] = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record


def _finished(directory: Path, seed: int, sizes: dict[str, int]) -> bool:
    record = read_marker(directory)
    if record is None or not (directory / "model.safetensors").exists():
        return False
    settings = record.get("settings", {})
    expected = {"format": _FORMAT, "seed": seed, **sizes}
    return all(settings.get(key) == value for key, value in expected.items())


def write_spec_fixture(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(directory/"target", directory/"draft")``: a :data:`TARGET` and a :data:`DRAFT`
    trained on the same corpus (same seed and tokenizer). Cached: a pair whose markers record
    this seed and these sizes is returned as it is, without training."""
    directory = Path(directory)
    target, draft = directory / "target", directory / "draft"
    for path, sizes in ((target, TARGET), (draft, DRAFT)):
        if not _finished(path, seed, sizes):
            train_copy_model(path, seed=seed, **sizes)
    return target, draft


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.common.trained --out DIR [--seed N]``: write (or reuse) the fixture
    and print each model's training time and held-out copy accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="fixture directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_spec_fixture(args.out, seed=args.seed):
        record = read_marker(path) or {}
        print(
            f"{path}: trained in {record.get('train_seconds')} s, "
            f"held-out copy accuracy {record.get('accuracy', float('nan')):.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
