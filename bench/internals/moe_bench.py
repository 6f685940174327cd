"""CPU benchmark of the mixture-of-experts op: the CPU path of ``pagedserve.kernels.ops.fused_moe``
against the alternatives it was chosen over.

- ``sorted-in-expert-order`` (:func:`pagedserve.kernels.cpu_moe.fused_moe_cpu`, the one served): one
  sort of the (slot, token) rows by expert, one gather of ``x``, a contiguous slice per
  hit expert, the rows put back at (token, rank of the expert) by one ``index_copy_`` and
  each token's ``k`` weighted terms added one by one;
- ``sorted-index-add``: the same rows, added into zeros by one ``index_add_`` (in fp16/bf16
  it rounds a token's sum once, not per term as transformers does);
- ``padded-bmm``: the rows of every expert padded to the largest group, two ``bmm``;
- ``per-expert-where`` (:func:`pagedserve.kernels.moe_reference.fused_moe_reference`, the loop of
  transformers and of the model before): a ``torch.where`` over the routing per expert,
  a gather and an ``index_add_`` per expert.

Routing is random top-k of softmaxed random logits. The variants run interleaved,
``--repeats`` rounds after warm-up; cells are min / median ms per call, and "differs" marks
a variant whose output is not bit-identical to the served one.

Usage: ``python -m bench.internals.moe_bench [--tokens 64 512] [--threads 1]``. Prints markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.cpu_moe import fused_moe_cpu
from pagedserve.kernels.moe_reference import fused_moe_reference
from pagedserve.kernels.reference import silu_and_mul

MoEFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def sorted_index_add(x: Tensor, tw: Tensor, ti: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    order = torch.argsort(ti.t().reshape(-1), stable=True)  # (slot, token) rows by expert
    counts = torch.bincount(ti.reshape(-1), minlength=w13.shape[0]).tolist()
    tokens = order % ti.shape[0]
    xs = x.index_select(0, tokens)
    y = x.new_empty(ti.numel(), x.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            h = silu_and_mul(F.linear(xs[rows], w13[e]))
            torch.mm(h, w2[e].t(), out=y[rows])
            start += n
    terms = (y * tw.t().reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, terms)


def padded_bmm(x: Tensor, tw: Tensor, ti: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    t, k = ti.shape
    e_num, hidden = w13.shape[0], x.shape[1]
    flat = ti.t().reshape(-1)  # (slot, token) rows
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e_num)
    width = int(counts.max())
    expert = flat[order]
    rank = torch.arange(t * k) - (counts.cumsum(0) - counts)[expert]
    xp = x.new_zeros(e_num, width, hidden)
    xp[expert, rank] = x[order % t]
    h = torch.bmm(xp, w13.transpose(1, 2))  # [E, W, 2I]
    h = silu_and_mul(h.view(-1, h.shape[-1])).view(e_num, width, -1)
    yp = torch.bmm(h, w2.transpose(1, 2))  # [E, W, H]
    y = (yp[expert, rank] * tw.t().reshape(-1)[order, None]).to(x.dtype)
    # Each token's terms in expert order: k passes of index_add_, one slot rank each.
    slot_rank = torch.empty_like(ti).scatter_(
        1, ti.argsort(dim=-1, stable=True), torch.arange(k).expand(t, k)
    )
    p_of_row = slot_rank.t().reshape(-1)[order]
    out = torch.zeros_like(x)
    for p in range(k):
        mask = p_of_row == p
        out.index_add_(0, (order % t)[mask], y[mask])
    return out


VARIANTS: dict[str, MoEFn] = {
    "sorted-in-expert-order": fused_moe_cpu,
    "sorted-index-add": sorted_index_add,
    "padded-bmm": padded_bmm,
    "per-expert-where": fused_moe_reference,
}


def _time_interleaved(fns: list[Callable[[], Tensor]], repeats: int) -> list[list[float]]:
    for fn in fns:
        for _ in range(2):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.05
    w2 = torch.randn(e, h, i, generator=gen) * 0.05
    print(f"E={e} k={args.top_k} H={h} I={i} fp32, {args.threads} thread(s)")
    print("min / median ms per call\n")
    print("| T | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for t in args.tokens:
        x = torch.randn(t, h, generator=gen)
        probs = torch.softmax(torch.randn(t, e, generator=gen), dim=-1)
        tw, ti = torch.topk(probs, args.top_k, dim=-1)
        expected = fused_moe_cpu(x, tw, ti, w13, w2)
        inputs = (x, tw, ti, w13, w2)
        calls = [lambda fn=fn, inputs=inputs: fn(*inputs) for fn in VARIANTS.values()]
        cells = []
        for fn, ms in zip(VARIANTS.values(), _time_interleaved(calls, args.repeats), strict=True):
            exact = torch.equal(fn(x, tw, ti, w13, w2), expected)
            cells.append(
                f"{min(ms):.2f} / {statistics.median(ms):.2f}{'' if exact else ' (differs)'}"
            )
        print(f"| {t} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
