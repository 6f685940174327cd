"""The verification rule's distribution: with a one-token draft (the n-gram proposer's q is
one-hot), sampling each row and accepting while it equals the draft is speculative sampling's
rejection rule, so the outputs are distributed as the target's. vLLM's test of its rejection
sampler, on a vocabulary of 10 with k = 2: as the samples grow from 100 to 100,000, the
distance to the target shrinks at least 20 times more than the distance to random
references."""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingParams
from services.executor.core.plan import ScheduledChunk
from services.executor.core.sampler import Sampler, SeededGenerators
from services.executor.core.sequence import RequestKey, Sequence
from services.executor.core.spec.verify import verify

VOCAB, K = 10, 2
DRAFTS = [3, 7]


def _target() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(K + 1, VOCAB, generator=g) * 1.5, dim=-1)


def _samples(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second output tokens of ``num`` sequences verified in one batch (the
    second only where the first draft was accepted: -1 elsewhere)."""
    p = _target()
    params = SamplingParams(temperature=1.0)
    chunks = []
    for i in range(num):
        seq = Sequence(i, RequestKey(0, f"r{i}"), 0, [1, 2], 1, params, 0, i)
        seq.draft_token_ids, seq.num_scheduled_drafts = list(DRAFTS), K
        chunks.append(ScheduledChunk(seq, K + 1, True))
    logits = torch.log(p).repeat(num, 1)
    _, verified = verify(
        chunks,
        logits,
        Sampler(torch.device("cpu"), seed),
        SeededGenerators(torch.device("cpu")),
        (),
    )
    first = torch.tensor([v.tokens[0] for v in verified])
    second = torch.tensor([v.tokens[1] if len(v.tokens) > 1 else -1 for v in verified])
    return first, second


def _distribution(tokens: torch.Tensor) -> torch.Tensor:
    tokens = tokens[tokens >= 0]
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


def test_the_outputs_converge_to_the_target_and_not_to_random_distributions():
    p = _target()
    refs = torch.softmax(torch.randn(50, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    distance: dict[int, tuple[float, float]] = {}
    for num in (100, 100_000):
        first, _ = _samples(num, seed=num)
        empirical = _distribution(first)
        to_target = float((empirical - p[0]).abs().sum())
        to_refs = float((empirical - refs).abs().sum(dim=-1).mean())
        distance[num] = (to_target, to_refs)
    target_shrink = distance[100][0] / distance[100_000][0]
    refs_shrink = distance[100][1] / distance[100_000][1]
    assert target_shrink >= 20 * refs_shrink, distance


def test_after_an_accepted_draft_the_next_token_follows_the_next_row():
    p = _target()
    first, second = _samples(100_000, seed=7)
    accepted = (first == DRAFTS[0]).float().mean()
    assert abs(float(accepted) - float(p[0, DRAFTS[0]])) < 0.01  # accepted with p(d)
    empirical = _distribution(second)
    assert float((empirical - p[1]).abs().sum()) < 0.05
