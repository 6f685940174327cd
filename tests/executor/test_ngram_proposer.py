"""The n-gram proposer drafts what transformers' ``PromptLookupCandidateGenerator`` drafts
(prompt lookup, earliest match of the longest n-gram first, stopped before an EOS)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from services.executor.core.spec.ngram import propose_ngram
from tests.hypothesis_budget import examples

EOS = 7


def _hf(tokens: list[int], num_tokens: int, max_n: int) -> list[int]:
    generator = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor([EOS]),
        num_output_tokens=num_tokens,
        max_matching_ngram_size=max_n,
        max_length=10**6,
    )
    ids = torch.tensor([tokens])
    candidates, _ = generator.get_candidates(ids)
    return candidates[0, len(tokens) :].tolist()


@settings(max_examples=examples(300), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 8), min_size=2, max_size=60),
    num_tokens=st.integers(1, 8),
    max_n=st.integers(1, 4),
)
def test_drafts_equal_transformers_prompt_lookup(tokens, num_tokens, max_n):
    got = propose_ngram(tokens, num_tokens, max_n=max_n, stop_token_ids=frozenset({EOS}))
    assert got == _hf(tokens, num_tokens, max_n)


def test_a_repeated_passage_is_drafted_from_its_first_occurrence():
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    tokens = [1, 2, *passage, 3, 4, *passage[:3]]
    assert propose_ngram(tokens, 4, max_n=3) == [14, 15, 16, 17]
    assert propose_ngram(tokens, 4, min_n=4, max_n=4) == []  # no 4-gram repeats
    assert propose_ngram([5, 6, 9], 4) == []  # nothing repeats
