"""GPU check of the kernels the newer model families use: correctness against the torch
references, then timings.

    python -m bench.internals.gpu_check_families [--iters N] [--cpu-dry-run]

1. Sliding-window decode attention (Mistral / Gemma sliding layers): Llama-3-8B heads (32 q /
   8 kv, head_dim 128), block 16, bf16, batch 64 at a 16k context, with no window and windows
   of 4096 and 1024 tokens: the kernel ``ops.paged_attention`` picks, its time, and the speed-up
   over the full context (the window's blocks are all it reads). Checked against the
   reference on the first sequences.
2. Attention with logit soft-capping (Gemma 2), the same shapes, window 4096: time and check.
3. The fused mixture of experts (``pagedserve/kernels/fused_moe.py``), Mixtral-8x7B's expert shapes
   (8 experts, top-2, hidden 4096, expert width 14336), bf16, 1 to 4096 tokens: time against
   the per-expert loop of the reference, and its error.

Timing: CUDA events, 3 warm-up calls, median of ``--iters`` (the L2 is not flushed: these are
compute-heavy). ``--cpu-dry-run`` runs every step on CPU under the Triton interpreter with
tiny shapes and fp16 (timings meaningless), to prove the script before it meets a GPU. Exit
status 1 if a check fails; 0 without CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import ops, reference
from pagedserve.kernels.moe_reference import fused_moe_reference


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: torch.dtype
    batch: int
    context: int
    windows: tuple[int, ...]
    heads: tuple[int, int, int]  # query heads, KV heads, head_dim
    moe: tuple[int, int, int, int]  # experts, top-k, hidden, expert width
    moe_tokens: tuple[int, ...]
    tol: float


CUDA_PLAN = Plan(
    "cuda", torch.bfloat16, 64, 16384, (4096, 1024), (32, 8, 128), (8, 2, 4096, 14336),
    (1, 16, 64, 256, 1024, 4096), 3e-2,
)  # fmt: skip
DRY_RUN_PLAN = Plan("cpu", torch.float16, 3, 96, (40, 17), (4, 2, 16), (4, 2, 32, 48), (1, 5), 3e-3)
BLOCK_SIZE = 16


def timer(plan: Plan, iters: int) -> Callable[[Callable[[], object]], float]:
    def measure(fn: Callable[[], object]) -> float:
        if plan.device != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events)

    return measure


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        self.count += 1
        err = (got.float() - want.float()).abs().max().item()
        ok = err <= tol
        print(f"{'PASS' if ok else 'FAIL'} {name}: max abs error {err:.2e}")
        if not ok:
            self.failures.append(name)


def attention(plan: Plan, measure: Callable, checks: Checks) -> None:
    nq, nkv, d = plan.heads
    b, ctx, dev, dtype = plan.batch, plan.context, plan.device, plan.dtype
    per_seq = ctx // BLOCK_SIZE
    num_blocks = b * per_seq + 1
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, nkv, d, device=dev, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = (torch.randperm(num_blocks - 1, device=dev) + 1).view(b, per_seq).to(torch.int32)
    query = torch.randn(b, nq, d, device=dev, dtype=dtype)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    args = (query, key_cache, value_cache, tables, qsl, lens, d**-0.5)
    hints = {"max_query_len": 1, "max_seq_len": ctx}
    few = slice(0, 2)  # the reference on two sequences: enough to check, cheap on any device
    few_args = (query[few], key_cache, value_cache, tables[few], qsl[:3], lens[few], d**-0.5)

    print("\n| window | soft-cap | time (us) | vs full context |\n|---:|---:|---:|---:|")
    full_us = measure(lambda: ops.paged_attention(*args, **hints))
    print(f"| - | - | {full_us:.1f} | 1.00 |")
    cases = [(w, None) for w in plan.windows] + [(plan.windows[0], 30.0)]
    for window, cap in cases:
        kw = {"sliding_window": window, "logits_soft_cap": cap}
        us = measure(lambda kw=kw: ops.paged_attention(*args, **hints, **kw))
        print(f"| {window} | {cap or '-'} | {us:.1f} | {full_us / us:.2f}x faster |")
        got = ops.paged_attention(*few_args, max_query_len=1, max_seq_len=ctx, **kw)
        want = reference.paged_attention(*few_args, **kw)
        checks.close(f"decode window {window} soft-cap {cap}", got, want, plan.tol)


def mixture_of_experts(plan: Plan, measure: Callable, checks: Checks) -> None:
    from pagedserve.kernels.fused_moe import fused_moe_triton

    e, k, h, inter = plan.moe
    dev, dtype = plan.device, plan.dtype
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype) * h**-0.5
    w2 = torch.randn(e, h, inter, device=dev, dtype=dtype) * inter**-0.5
    print("\n| tokens | fused (us) | per-expert loop (us) | loop / fused |\n|---:|---:|---:|---:|")
    for t in plan.moe_tokens:
        x = torch.randn(t, h, device=dev, dtype=dtype)
        probs = torch.softmax(torch.randn(t, e, device=dev), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        fused_us = measure(lambda x=x, w=weights, i=ids: fused_moe_triton(x, w, i, w13, w2))
        loop_us = measure(lambda x=x, w=weights, i=ids: fused_moe_reference(x, w, i, w13, w2))
        print(f"| {t} | {fused_us:.1f} | {loop_us:.1f} | {loop_us / fused_us:.2f} |")
        got = fused_moe_triton(x, weights, ids, w13, w2)
        want = fused_moe_reference(x.float(), weights, ids, w13.float(), w2.float())
        checks.close(f"fused MoE {t} tokens", got, want, plan.tol * 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ["PAGEDSERVE_FORCE_TRITON"] = "1"
        plan = DRY_RUN_PLAN
        print("CPU dry run under the Triton interpreter: timings are meaningless")
    elif not torch.cuda.is_available():
        print("no CUDA: nothing to check")
        return 0
    else:
        plan = CUDA_PLAN
        print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    torch.manual_seed(0)
    checks = Checks()
    measure = timer(plan, args.iters)
    attention(plan, measure, checks)
    mixture_of_experts(plan, measure, checks)
    print(f"\n{checks.count - len(checks.failures)}/{checks.count} checks passed")
    if checks.failures:
        print("FAILED: " + ", ".join(checks.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
