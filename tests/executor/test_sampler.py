"""The sampler's greedy choice on the CPU (numpy's argmax, for speed) is torch's argmax."""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingParams
from services.executor.core.sampler import Sampler


def test_cpu_greedy_picks_the_first_maximum_exactly_as_torch_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 50), generator=gen).float()  # many ties per row
    logits[5] = float("-inf")
    logits[6, 10:] = float("-inf")
    logits[7, 3] = float("nan")  # NaN wins in both
    logits[8, [2, 40]] = 1e30
    greedy = [SamplingParams(temperature=0.0)] * logits.shape[0]
    got = Sampler(torch.device("cpu"))(logits, greedy, {}).token_ids
    assert got == torch.argmax(logits, dim=-1).tolist()
    assert got[7] == 3 and got[8] == 2


def test_cpu_sampling_draws_from_the_tempered_distribution_through_the_same_argmax() -> None:
    """Exponential-race sampling (argmax of probs / q) through numpy's argmax: a token holding
    90% of the mass is chosen about 90% of the time, one with no mass never."""
    logits = torch.full((4000, 3), float("-inf"))
    logits[:, 0], logits[:, 1] = 0.0, float(torch.log(torch.tensor(9.0)))
    params = [SamplingParams(temperature=1.0)] * logits.shape[0]
    tokens = torch.tensor(Sampler(torch.device("cpu"), seed=1)(logits, params, {}).token_ids)
    assert (tokens != 2).all()
    assert 0.87 < (tokens == 1).float().mean().item() < 0.93
