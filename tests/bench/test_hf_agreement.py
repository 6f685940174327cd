"""``bench.common.hf.hf_agreement``, which scores an engine's greedy tokens against HF's
model on the GPU bench (``gpu_engine``): where the tokens leave the reference's argmax, and
whether that is a near-tie or a real mismatch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.common.hf import hf_agreement


class _Scores:
    """A causal LM's output for hf_agreement: fixed logits rows (one per input position)."""

    device = torch.device("cpu")

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = torch.tensor(rows)

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.rows[None, : ids.shape[1]])


def test_hf_agreement_tells_a_near_tie_from_a_mismatch() -> None:
    # prompt [0]; rows 0..2 predict the 3 tokens; row 1's best (2) leads token 1 by 0.05.
    rows = [[0.0, 9.0, 1.0], [1.0, 4.95, 5.0], [9.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    model = _Scores(rows)
    assert hf_agreement(model, [0], [1, 2, 0], 0.01) == (None, 0.0, True)  # type: ignore[arg-type]
    tie = hf_agreement(model, [0], [1, 1, 0], 0.02)  # type: ignore[arg-type]
    assert tie.first == 1 and tie.tie and abs(tie.margin - 0.05) < 1e-6
    far = hf_agreement(model, [0], [1, 0, 0], 0.02)  # type: ignore[arg-type]
    assert far.first == 1 and not far.tie and abs(far.margin - 4.0) < 1e-6
