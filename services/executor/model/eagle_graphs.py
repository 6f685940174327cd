"""CUDA graphs for an EAGLE-3 head's drafting forwards (:class:`HeadGraphs`).

After the catch-up forward (the step's rows with the target's features, eager), each further
draft is one forward of the head over one token a sequence, fed the head's own pre-norm
output of the draft before: ``k - 1`` small forwards a step, each hundreds of kernel
launches if run eagerly. They are captured per batch size as the target's decode steps are
(:class:`~.cuda_graphs.CapturedForwards`): padding sequences write no K/V, and the state fed
in lives in a persistent buffer beside the token buffers, so a forward costs three copies
and one launch. Both outputs (logits over the target's vocabulary, the pre-norm output) are
the graph's, a row per sequence, padding's last."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from services.executor.model.cuda_graphs import CapturedForwards, GraphBackend, Outputs
from services.executor.model.forward_batch import BatchBuilder, ForwardBatch, GraphKey, SeqChunk

__all__ = ["HeadForward", "HeadGraphs"]

# A head's forward: (batch, its KV cache, a state row per token) -> (logits, pre-norm output).
HeadForward = Callable[[ForwardBatch, Tensor, Tensor], tuple[Tensor, Tensor]]


class HeadGraphs(CapturedForwards):
    """The captured one-token-a-sequence runs of a head's ``forward`` over its ``kv_cache``,
    fed states ``width`` wide of ``dtype``, for the batch ``sizes`` of at most
    ``max_model_len`` positions (no verification shapes: its catch-up runs eagerly)."""

    def __init__(
        self,
        forward: HeadForward,
        width: int,
        dtype: torch.dtype,
        max_model_len: int,
        kv_cache: Tensor,
        builder: BatchBuilder,
        sizes: Sequence[int],
        backend: GraphBackend,
    ) -> None:
        super().__init__(kv_cache, builder, sizes, backend, max_model_len)
        self.forward, self.width = forward, width
        self.state = torch.zeros(self.max_size, width, dtype=dtype, device=kv_cache.device)

    def _outputs(self, batch: ForwardBatch, key: GraphKey) -> Outputs:
        return self.forward(batch, self.kv_cache, self.state[: key.num_seqs])

    def serves(self, chunks: Sequence[SeqChunk], hidden: Tensor) -> GraphKey | None:
        """The graph that runs ``chunks`` fed ``hidden``, or None (run eagerly): one token and
        a logits row a sequence, fed the head's own state."""
        if hidden.shape[-1] != self.width:
            return None  # (the target's features: the catch-up)
        key = self.bucket(chunks)
        return key if key is not None and key.query_len == 1 else None

    @torch.inference_mode()
    def run(
        self, chunks: Sequence[SeqChunk], hidden: Tensor, key: GraphKey
    ) -> tuple[Tensor, Tensor]:
        """Replay the graph of ``key`` over ``chunks`` fed ``hidden``: (logits, pre-norm
        output) of the chunks' rows."""
        host = self.host_batch(chunks, key)
        self.builder.upload_packed(host, into=self.buffers)
        n = len(chunks)
        self.state[:n].copy_(hidden, non_blocking=True)
        logits, state = self._replay(key)
        return logits[:n], state[:n]
