"""The transformers reference loops: ``generate()`` on left-padded static batches, greedy or
beam search (what the benchmarks compare the engine's speed and tokens with)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

__all__ = ["Agreement", "hf_agreement", "hf_argmax", "hf_beams", "hf_generate", "pad_left"]


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one left-padded batch: (input ids, attention mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    pad_id: int,
    *,
    exact: bool = True,
) -> list[list[int]]:
    """Greedy ``generate()`` of one static batch, run to the largest of ``max_tokens`` (on
    the model's device): each row's first ``max_tokens[i]`` new tokens (the rest is the
    static batch's wasted work). ``exact``: every row generates all of them (the model's EOS
    must then be unset, as ``ignore_eos``), else a row may end at EOS."""
    ids, mask = pad_left(prompts, pad_id)
    n = max(max_tokens)
    at_least = {"min_new_tokens": n} if exact else {}
    out = model.generate(
        ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=pad_id,
        **at_least,
    )
    if exact:
        assert out.shape[1] == ids.shape[1] + n, "generate stopped early"
    width = ids.shape[1]
    return [out[i, width : width + m].tolist() for i, m in enumerate(max_tokens)]


@torch.inference_mode()
def hf_beams(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], k: int, max_tokens: int
) -> list[list[list[int]]]:
    """Beam search of width ``k`` (``num_return_sequences = k``, greedy, no end token, as
    ``ignore_eos``) on one left-padded batch: each prompt's ``k`` beams, best first."""
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = [model.config.vocab_size + 1]  # no end token, as ignore_eos
    pad = int(model.config.pad_token_id)
    ids, mask = pad_left(prompts, pad)
    out = model.generate(
        ids,
        attention_mask=mask,
        generation_config=gc,
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_tokens,
        pad_token_id=pad,
    )
    width = ids.shape[1]
    return [[out[i * k + j, width:].tolist() for j in range(k)] for i in range(len(prompts))]


class Agreement(NamedTuple):
    """One request's greedy tokens against the reference model's, teacher-forced: ``first``
    is the first position where ours is not the reference's argmax (None: every token
    agrees), ``margin`` the reference's logit gap there (its max minus our token's logit),
    ``tie`` whether that gap is within the tolerance (a near-tie that a rounding flips)."""

    first: int | None
    margin: float
    tie: bool


@torch.inference_mode()
def hf_agreement(
    model: PreTrainedModel,
    prompt: Sequence[int],
    tokens: Sequence[int],
    tie_tolerance: float,
) -> Agreement:
    """Score ``tokens`` (greedy, after ``prompt``) with one teacher-forced forward of
    ``model``: where they first leave its argmax and by how much. A gap of at most
    ``tie_tolerance`` times the largest |logit| there counts as a tie (bf16 keeps 8 bits of
    mantissa: two orders of accumulation may flip a near-tie)."""
    if not tokens:
        return Agreement(None, 0.0, True)
    ids = torch.tensor([[*prompt, *tokens]], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # the rows predicting tokens
    ours = torch.tensor(list(tokens), device=logits.device)
    best = logits.argmax(-1)
    differ = (best != ours).nonzero()
    if differ.numel() == 0:
        return Agreement(None, 0.0, True)
    i = int(differ[0])
    row = logits[i]
    margin = float(row[best[i]] - row[ours[i]])
    return Agreement(i, margin, margin <= tie_tolerance * float(row.abs().max()))


@torch.inference_mode()
def hf_argmax(model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """``model``'s argmax at each of ``tokens``' positions, teacher-forced on ``tokens`` (one
    forward; on the CPU): what it would have picked there after the same prefix."""
    ids = torch.tensor([[*prompt, *tokens]], device=model.device)
    return model(ids).logits[0, len(prompt) - 1 : -1].float().argmax(-1).cpu()
