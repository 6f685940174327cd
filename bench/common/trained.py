"""A trained fixture for speculative-decoding benchmarks: tiny Llamas that have learnt to copy.

Random checkpoints (:mod:`.models`) accept drafts by chance alone. These learn, on the CPU in
minutes, induction heads (``... a b ... a`` -> ``b``) from sequences that repeat spans of
themselves, so on :func:`copy_prompts` the target continues the passage as a draft model and
prompt lookup propose. ``python -m bench.common.trained --out DIR`` writes DIR/target and
DIR/draft (tiny tokenizer, tied embeddings)."""

from __future__ import annotations

import argparse
import functools
import inspect
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

__all__ = ["DRAFT", "TARGET", "copy_corpus", "copy_prompts", "train_copy_model"]
__all__ += ["LARGE", "ordinary_vocab", "read_marker", "write_large_target", "write_spec_fixture"]

MARKER = "copy_fixture.json"  # written last: a finished checkpoint, its settings and scores
_FORMAT = 2  # bump when the corpus or the training changes, so that cached fixtures retrain
_HELDOUT_SEED = 1_000_003  # held-out sequences: corpus seed + this
_COPY_PROB = 0.85  # per segment: copy a span (4-16 tokens), else add a quarter as many fresh
_NEAR_PROB = 0.25  # a copy is a near one: from 2 back, overlapping (a b a b a b)
_CONTINUE_PROB = 0.8  # a far copy right after another goes on from where that one's ended
_PREV_PAIRS, _PREV_SCALE = 6, 7.0  # the primed previous-token head's query
_GROW_NOISE = 0.01  # of each grown weight's std
_OUTPUTS = ("o_proj.weight", "down_proj.weight")  # a layer's writes to the residual stream
_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
_INIT: dict[str, Any] = {"arch": "llama", "tie_word_embeddings": True, "init_std": 0.02}
_SCORES = ("train_seconds", "initial_loss", "loss", "initial_accuracy", "accuracy")
_FRESH, _FAR, _NEAR = 0, 1, 2  # per token: unpredictable, far-copied, near-copied

#: :func:`train_copy_model` settings of the fixture's draft (from scratch) and target (grown).
DRAFT: dict[str, Any] = {}
TARGET: dict[str, Any] = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4)
TARGET.update(intermediate_size=512, steps=1000, final_lr=2e-4, until_accuracy=None)

#: The weight-bound target (:func:`write_large_target`): :data:`TARGET` grown twice as wide
#: and as deep, 19 M parameters (77 MB in fp32: a batch-1 forward reads them from memory).
LARGE: dict[str, Any] = dict(hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=8)
LARGE.update(intermediate_size=1024)


@functools.cache
def _tokenizer_ids() -> tuple[frozenset[int], int, int]:
    """The tiny tokenizer's special ids, its BOS id and its vocabulary size."""
    tokenizer = build_tokenizer()
    ids = [tokenizer.token_to_id(tok) or 0 for tok in (BOS, EOS, PAD, *ROLE_TOKENS)]
    return frozenset(ids), ids[0], tokenizer.get_vocab_size()


def ordinary_vocab() -> range:
    """The tiny tokenizer's ordinary ids: past its special ones (pad, bos, eos, chat roles)."""
    special, _, size = _tokenizer_ids()
    return range(max(special) + 1, size)


def _copy_sequence(rng: random.Random, length: int, tokens: list[int]) -> tuple[list[int], ...]:
    """A sequence and its tokens' kinds. Every segment's first token is fresh (not trained
    on): where a segment ends and which kind comes next is random. Trained on, a near copy's
    first token taught the model to turn to ``a b a b`` in the middle of a long copy (after
    6-38 tokens on half the bench's prompts)."""
    ids = [rng.choice(tokens) for _ in range(rng.randint(length // 4, length // 2))]
    kinds = [_FRESH] * len(ids)
    source = -1  # where the last far copy's source ended; -1: the last segment was not one
    while len(ids) < length:
        kind, span = _FAR, rng.randint(4, 16)
        if rng.random() >= _COPY_PROB:
            kind, piece = _FRESH, [rng.choice(tokens) for _ in range(span // 4)]
        elif rng.random() < _NEAR_PROB:
            kind, piece = _NEAR, (ids[-2:] * span)[:span]
        else:
            if source < 0 or rng.random() >= _CONTINUE_PROB:
                source = rng.randrange(max(1, len(ids) - span + 1))
            piece = ids[source : source + span]
        source = source + len(piece) if kind == _FAR else -1
        ids += piece
        kinds += [_FRESH] + [kind] * (len(piece) - 1)  # a switch of segment is unpredictable
    return ids[:length], kinds[:length]


def _corpus(seed: int, num: int, length: int, vocab: range) -> list[tuple[list[int], ...]]:
    tokens, rng = [t for t in vocab if t not in _tokenizer_ids()[0]], random.Random(seed)
    return [_copy_sequence(rng, length, tokens) for _ in range(num)]


def copy_corpus(seed: int, num_sequences: int, length: int, vocab: range) -> list[list[int]]:
    """``num_sequences`` sequences of ``length`` ids from ``vocab`` (its special ids left
    out), the same for a given seed. Each starts with random ids (a quarter to half of it),
    then segments of 4-16 tokens: with probability 0.85 a copy, else a quarter as many fresh
    random ids. A copy is, one time in four, a near one (from 2 back, overlapping: ``a b a b``,
    which teaches previous-token heads); else a far one, from a random earlier place or, 4
    times in 5 after a far copy, from where that one's source ended (long repeats). No BOS:
    the trainer prepends it."""
    return [seq[0] for seq in _corpus(seed, num_sequences, length, vocab)]


def copy_prompts(seed: int, num: int, prompt_len: int, vocab: range) -> list[list[int]]:
    """``num`` prompts of ``prompt_len`` ids (BOS first, like the benchmarks' other prompts):
    a random passage of distinct ids, then its first eighth (at least 4 ids) again, which a
    copying model continues, so that drafts get accepted. Distinct, because the fixture's
    induction heads look one token back: after an id that occurs twice in the passage they
    may go on from either place, and one wrong turn ends the copy (with repeats allowed its
    greedy output followed the passage for 12 tokens on average, against 35 without). Keep
    prompt and output within 128 tokens (the models' ``max_len``)."""
    tokens, rng = [t for t in vocab if t not in _tokenizer_ids()[0]], random.Random(seed)
    repeat = max(4, (prompt_len - 1) // 8)
    if (passage_len := prompt_len - 1 - repeat) < repeat:
        raise ValueError(f"prompt_len {prompt_len} is too short for a passage and its repeat")
    passages = [rng.sample(tokens, passage_len) for _ in range(num)]
    return [[_tokenizer_ids()[1], *passage, *passage[:repeat]] for passage in passages]


def _forward(model: torch.nn.Module, rows: list[tuple[list[int], ...]]) -> tuple[Any, ...]:
    """The output on ``rows`` (BOS first; the loss on copied tokens only), the ids, kinds."""
    ids = torch.tensor([[_tokenizer_ids()[1], *row[0]] for row in rows])
    kinds = torch.tensor([[_FRESH, *row[1]] for row in rows])
    return model(input_ids=ids, labels=ids.masked_fill(kinds == _FRESH, -100)), ids, kinds


@torch.no_grad()
def _evaluate(model: torch.nn.Module, seed: int, num: int, length: int) -> tuple[float, float]:
    """(loss on copied tokens, copy accuracy: the share of far-copied tokens that the argmax
    before predicts) on ``num`` held-out sequences of ``length`` (corpus seed + an offset)."""
    model.eval()
    out, ids, kinds = _forward(model, _corpus(seed + _HELDOUT_SEED, num, length, ordinary_vocab()))
    right = (out.logits[:, :-1].argmax(-1) == ids[:, 1:])[kinds[:, 1:] == _FAR]
    return float(out.loss), float(right.float().mean())


@torch.no_grad()
def _prime(model: LlamaForCausalLM, seed: int) -> None:
    """Add a shared (seeded) direction to the embeddings, and point layer 0's first query and
    key heads along it, turned so that RoPE makes the head attend to the previous token."""
    embed, layer = model.model.embed_tokens.weight, model.model.layers[0]
    shared = torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(seed))
    embed += embed.norm(dim=1).mean() * shared / shared.norm()
    mean = layer.input_layernorm(embed[list(ordinary_vocab())]).mean(0)
    dim, rope = int(model.config.head_dim or 0), dict(model.config.rope_parameters or {})
    angle = float(rope["rope_theta"]) ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    query = torch.zeros(dim)
    query[:_PREV_PAIRS] = _PREV_SCALE  # the fastest-turning pairs tell offset 1 apart best
    (q1, q2), cos, sin = query.chunk(2), angle.cos(), angle.sin()
    key = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin])  # the query, a step on
    layer.self_attn.q_proj.weight[:dim] = torch.outer(query, mean / mean.dot(mean))
    layer.self_attn.k_proj.weight[:dim] = torch.outer(key, mean / mean.dot(mean))


@torch.no_grad()
def _grow(model: LlamaForCausalLM, small: LlamaForCausalLM, seed: int) -> None:
    """Make ``model`` compute what ``small`` (half as wide, as deep or less) does: each unit
    twice (linear maps as 2x2 blocks of their half; the final norm halved for the tied logits),
    extra layers with zero output projections; seeded noise lets the twin units part."""
    params, generator = dict(model.named_parameters()), torch.Generator().manual_seed(seed)
    for name, weight in small.named_parameters():
        if name.endswith("embed_tokens.weight"):
            grown = torch.cat([weight, weight], dim=1)
        elif weight.ndim == 1:
            grown = torch.cat([weight, weight]) / (2 if name == "model.norm.weight" else 1)
        else:
            grown = torch.cat([torch.cat([weight, weight], dim=1)] * 2) / 2
            grown += _GROW_NOISE * weight.std() * torch.randn(grown.shape, generator=generator)
        params[name].copy_(grown)
    for name, param in params.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= small.config.num_hidden_layers and name.endswith(_OUTPUTS):
            param.zero_()


def _lr_factor(step: int, steps: int, final: float) -> float:
    """The learning rate's factor at ``step``: a linear warmup over 50 steps, then from 1
    down to ``final`` by ``steps`` along a half cosine (constant when ``final`` is 1)."""
    if step < 50:
        return (step + 1) / 50
    done = min(1.0, (step - 50) / max(1, steps - 50))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * done))


def train_copy_model(
    directory: Path,
    *,
    seed: int = 0,
    steps: int = 1500,
    batch_size: int = 16,
    lr: float = 2e-3,
    final_lr: float | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_len: int = 128,
    until_accuracy: float | None = 0.8,
    grow_from: Path | None = None,
    threads: int | None = 1,
) -> Path:
    """Write a Llama to ``directory`` (``write_tiny_model``: tied embeddings, init std 0.02,
    positions to ``max(2048, max_len)``), train it to copy, save it (safetensors, reloaded as
    a check) and record in :data:`MARKER` the settings, time, held-out loss and accuracy.

    From scratch, the embeddings get a shared direction and one layer-0 head a previous-token
    query and key (:func:`_prime`; the rest of the induction circuit is learnt: without it the
    plateau outlasted 3000 steps); with ``grow_from`` (a trained model half as wide) the model
    starts as a widened, deepened copy of it (:func:`_grow`). AdamW (fp32, warmup, then a
    constant lr, or one that falls to ``final_lr`` along a half cosine; gradients clipped at
    1) runs up to ``steps`` steps on :func:`copy_corpus`
    batches of ``max_len`` tokens (BOS first; the loss on copied tokens only), on ``threads``
    threads (1: the same weights anywhere; None: the caller's), stopping once the accuracy on
    16 held-out sequences (checked every 50 steps) reaches ``until_accuracy``.

    Measured (seed 0, this 2-core machine, 1 thread, beside another job): these defaults (the
    fixture's draft, 0.4 M parameters) trained 450 steps in 41 s, held-out copy accuracy
    0.827; :data:`TARGET` (2.6 M, grown from it) 1,000 steps in 494 s, accuracy 0.867, its
    greedy output following the bench's passages for 46.9 of 48 tokens (200 constant-rate
    steps: 0.858 and 37.3; 600: 0.867 and 41.0). How soon copying forms depends on the seed:
    with seed 1 it had not after 1500 steps (0.24).
    Prompt and output should fit in ``max_len`` tokens: the models do not copy past it.
    """
    settings = {k: v for k, v in locals().items() if k not in ("directory", "threads")}
    settings["grow_from"], directory = grow_from and str(grow_from), Path(directory)
    (directory / MARKER).unlink(missing_ok=True)
    sizes = {k: settings[k] for k in _SIZES} | {"max_position_embeddings": max(2048, max_len)}
    write_tiny_model(directory, seed=seed, **sizes, **_INIT)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads or caller_threads)
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        if grow_from:
            _grow(model, LlamaForCausalLM.from_pretrained(grow_from, dtype=torch.float32), seed)
        else:
            _prime(model, seed)
        initial_loss, initial_accuracy = _evaluate(model, seed, 64, max_len - 1)
        corpus = _corpus(seed, steps * batch_size, max_len - 1, ordinary_vocab())
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(_lr_factor, steps=steps, final=(final_lr or lr) / lr)
        )
        start, trained = time.perf_counter(), steps
        for step in range(steps):
            check = step and step % 50 == 0 and until_accuracy is not None
            if check and _evaluate(model, seed, 16, max_len - 1)[1] >= (until_accuracy or 0):
                trained = step  # the copy accuracy is reached
                break
            model.train()
            out = _forward(model, corpus[step * batch_size : (step + 1) * batch_size])[0]
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        seconds = time.perf_counter() - start
        model.save_pretrained(directory, safe_serialization=True)
        reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        final_loss, accuracy = _evaluate(reloaded, seed, 64, max_len - 1)
    finally:
        torch.set_num_threads(caller_threads)
    scores = [seconds, initial_loss, final_loss, initial_accuracy, accuracy]
    rounded = dict(zip(_SCORES, (round(v, 4) for v in scores), strict=True))
    record = {"format": _FORMAT, "settings": settings, "trained_steps": trained, **rounded}
    (directory / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return directory


def read_marker(directory: Path) -> dict[str, Any] | None:
    """What ``directory``'s :data:`MARKER` records; None without one (not finished)."""
    try:
        return dict(json.loads((Path(directory) / MARKER).read_text()))
    except (OSError, ValueError):
        return None


def _is_cached(path: Path, seed: int, overrides: dict[str, Any]) -> bool:
    params = inspect.signature(train_copy_model).parameters.values()
    expected = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY} | overrides
    expected.update(seed=seed, grow_from=expected["grow_from"] and str(expected["grow_from"]))
    del expected["threads"]
    record = read_marker(path) or {}
    fresh = record.get("format") == _FORMAT and record.get("settings") == expected
    return fresh and (path / "model.safetensors").exists()


def write_spec_fixture(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(directory/"target", directory/"draft")``: a :data:`DRAFT` trained from scratch and a
    :data:`TARGET` grown from it, on the same corpus (seed) and tokenizer. Cached: a model
    whose marker records this seed, these settings and corpus format is kept (the target
    unless its draft was retrained). Raises RuntimeError if the draft did not learn to copy."""
    target, draft = Path(directory) / "target", Path(directory) / "draft"
    target_settings = {**TARGET, "grow_from": draft}
    if retrained := not _is_cached(draft, seed, DRAFT):
        train_copy_model(draft, seed=seed, **DRAFT)
    if (read_marker(draft) or {}).get("accuracy", 0) < 0.5:
        raise RuntimeError(f"{draft} did not learn to copy (seed {seed}): try another seed")
    if retrained or not _is_cached(target, seed, target_settings):
        train_copy_model(target, seed=seed, **target_settings)
    return target, draft


def write_large_target(directory: Path, target: Path, seed: int = 0) -> Path:
    """``directory``: a :data:`LARGE` Llama grown (:func:`_grow`) from the trained ``target``,
    not trained further: it computes what ``target`` does (up to the growth's seeded noise,
    which leaves its greedy copies as they were) at 8 times its weights, so that its decode
    is bound by reading them, as a real target's is and the 2.5 M one's (in cache) is not.
    Cached while ``target``'s marker is the one it was grown from."""
    directory = Path(directory)
    record = {"format": _FORMAT, "settings": LARGE, "seed": seed, "grown_from": read_marker(target)}
    if read_marker(directory) == record and (directory / "model.safetensors").exists():
        return directory
    (directory / MARKER).unlink(missing_ok=True)
    sizes = LARGE | {"max_position_embeddings": 2048}
    write_tiny_model(directory, seed=seed, **sizes, **_INIT)
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        _grow(model, LlamaForCausalLM.from_pretrained(target, dtype=torch.float32), seed)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.common.trained --out DIR [--seed N]``: write (or reuse) the fixture;
    print each model's steps, training time, held-out loss and copy accuracy."""
    parser = argparse.ArgumentParser(description="Train the speculative-decoding fixture.")
    parser.add_argument("--out", type=Path, required=True, help="fixture directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_spec_fixture(args.out, seed=args.seed):
        r = read_marker(path) or {}
        loss, accuracy = (f"{r[f'initial_{k}']} -> {r[k]}" for k in ("loss", "accuracy"))
        print(f"{path}: {r['trained_steps']} steps, {r['train_seconds']} s, loss {loss}, ", end="")
        print(f"held-out copy accuracy {accuracy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
