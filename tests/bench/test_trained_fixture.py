"""The speculative-decoding fixture (bench/common/trained.py): its copy corpus and prompts are
deterministic and really repeat themselves, growing a model keeps what it computes, and
training lowers the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from bench.common import trained
from bench.common.trained import (
    copy_corpus,
    copy_prompts,
    ordinary_vocab,
    read_marker,
    train_copy_model,
)
from pagedserve.tools.tiny_model import write_tiny_model


def _repeated_fraction(seq: list[int], n: int = 4) -> float:
    """The fraction of the second half's positions that end an n-gram seen before."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for end in range(n, len(seq) + 1):
        gram = tuple(seq[end - n : end])
        if end > len(seq) // 2:
            total += 1
            hits += gram in seen
        seen.add(gram)
    return hits / total


def test_copy_corpus_is_deterministic_and_copies() -> None:
    vocab = ordinary_vocab()
    assert not {0, 1, 2} & set(vocab)  # <pad>, <s>, </s>
    corpus = copy_corpus(3, 16, 128, vocab)
    assert corpus == copy_corpus(3, 16, 128, vocab)
    assert corpus != copy_corpus(4, 16, 128, vocab)
    assert all(len(seq) == 128 and set(seq) <= set(vocab) for seq in corpus)
    # Random 4-grams over ~600 ids almost never repeat by chance: these are copies.
    fractions = [_repeated_fraction(seq) for seq in corpus]
    assert min(fractions) > 0.2 and sum(fractions) / len(fractions) > 0.4
    # A narrower vocabulary narrows the ids, and the special ones stay out.
    assert set().union(*copy_corpus(0, 4, 64, range(0, 40))) <= set(range(6, 40))


def test_copy_prompts_repeat_their_passage_of_distinct_ids() -> None:
    prompts = copy_prompts(5, 4, 81, ordinary_vocab())
    assert prompts == copy_prompts(5, 4, 81, ordinary_vocab())
    for prompt in prompts:
        assert len(prompt) == 81 and prompt[0] == 1  # BOS
        passage, repeat = prompt[1:71], prompt[71:]
        assert len(repeat) == 10 and repeat == passage[:10]
        assert len(set(passage)) == len(passage)  # one place to go on from, for each id


def test_growing_keeps_the_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trained, "_GROW_NOISE", 0.0)
    write_tiny_model(tmp_path / "s", hidden_size=32, num_heads=4, num_kv_heads=2, **trained._INIT)
    write_tiny_model(
        tmp_path / "b",
        hidden_size=64,
        num_layers=3,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=256,
        **trained._INIT,
    )
    small = LlamaForCausalLM.from_pretrained(tmp_path / "s")
    big = LlamaForCausalLM.from_pretrained(tmp_path / "b")
    trained._grow(big, small, seed=0)
    ids = torch.tensor(copy_prompts(0, 2, 40, ordinary_vocab()))
    with torch.no_grad():
        torch.testing.assert_close(big(input_ids=ids).logits, small(input_ids=ids).logits)


def test_training_lowers_the_loss(tmp_path: Path) -> None:
    model_dir = train_copy_model(
        tmp_path / "m",
        steps=100,
        batch_size=8,
        lr=1e-2,
        hidden_size=32,
        max_len=32,
        until_accuracy=None,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
    )
    record = read_marker(model_dir)
    assert record is not None and record["trained_steps"] == 100
    assert record["loss"] < record["initial_loss"] - 0.05
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.hidden_size == 32
    assert AutoTokenizer.from_pretrained(model_dir).bos_token_id == 1


def test_the_learning_rate_warms_up_then_decays_to_its_final_value() -> None:
    factor = trained._lr_factor
    assert [factor(s, 1000, 0.1) for s in (0, 24, 49)] == [0.02, 0.5, 1.0]
    assert factor(50, 1000, 0.1) == 1.0 and factor(999, 1000, 0.1) == pytest.approx(0.1, 1e-4)
    assert factor(525, 1000, 0.1) == pytest.approx(0.55)  # halfway down the cosine
    assert {factor(s, 1000, 1.0) for s in range(50, 1200, 7)} == {1.0}  # no final_lr: constant


def test_the_large_target_computes_what_it_was_grown_from_and_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_large_target`` (the bench's weight-bound target) is the trained target grown
    twice as wide and deep: the same logits without the growth's noise; written once per
    target (its marker names the target's), rewritten when the target changes."""
    monkeypatch.setattr(trained, "_GROW_NOISE", 0.0)
    small = dict(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    monkeypatch.setattr(
        trained, "LARGE", dict(hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4)
    )
    trained.LARGE["intermediate_size"] = 128
    target = tmp_path / "target"
    write_tiny_model(target, num_layers=2, **small, **trained._INIT)
    (target / trained.MARKER).write_text('{"loss": 1.0}')
    large = trained.write_large_target(tmp_path / "large", target)
    ids = torch.tensor(copy_prompts(0, 2, 40, ordinary_vocab()))
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(target)(input_ids=ids).logits
        got = LlamaForCausalLM.from_pretrained(large)(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    assert LlamaForCausalLM.from_pretrained(large).config.num_hidden_layers == 4
    written = (large / "model.safetensors").stat().st_mtime_ns
    assert trained.write_large_target(tmp_path / "large", target) == large
    assert (large / "model.safetensors").stat().st_mtime_ns == written  # cached
    (target / trained.MARKER).write_text('{"loss": 0.5}')  # the target was retrained
    trained.write_large_target(tmp_path / "large", target)
    assert read_marker(large)["grown_from"] == {"loss": 0.5}  # type: ignore[index]
