"""A quantized KV cache on the GPU: one layer's paged attention for a batch-1 decode at long
contexts, bf16 against fp8 (e4m3, e5m2) and int8 caches, in one run:

    python -m bench.internals.gpu_kv_quant [--contexts 8192,32768]
    python -m bench.internals.gpu_kv_quant --cpu-dry-run   # every step, tiny, interpreted

Llama-3-8B's attention shape (32 query / 8 KV heads of 128, block size 16), one decode row
whose context fills shuffled blocks; ``ops.paged_attention`` picks the kernel (split-KV for
one long row), as the engine does. Each cache's output is checked against torch attention
over the same cache dequantized, then timed with CUDA events (median of ``--iters``, L2
flushed, the host's launch cost hidden: see ``time_ms``). Prints markdown; exit status 1 if a
check fails. Needs CUDA, except ``--cpu-dry-run``: fp16 queries, contexts of 40 and 200
tokens, the Triton kernels under the interpreter (both set before triton is imported), wall
clock: it proves the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

if __name__ == "__main__" and "--cpu-dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PAGEDSERVE_FORCE_TRITON"] = "1"

import torch

from pagedserve.kernels import kv_quant, ops, reference
from pagedserve.kernels.testing import TOLERANCES, make_paged_batch

CACHES: dict[str, torch.dtype | None] = {
    "auto (the query's dtype)": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median device time of ``fn`` (CUDA events around each call, no sync between calls:
    a 256 MiB memset before each evicts L2 and keeps the GPU busy while the host queues the
    call, so the host's launch cost is not what is timed); wall clock on the CPU."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--cpu-dry-run", action="store_true")
    args = p.parse_args()
    device, dtype, heads = "cuda", torch.bfloat16, (32, 8, 128)
    if args.cpu_dry_run:
        device, dtype, heads = "cpu", torch.float16, (4, 2, 32)
        args.contexts, args.iters = "40,200", 1
    elif not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    ok = True
    print("| context | cache | attention us | x auto | matches the dequantized reference |")
    print("|---:|---|---:|---:|---|")
    for context in map(int, args.contexts.split(",")):
        base = None
        for name, cache_dtype in CACHES.items():
            batch = make_paged_batch(
                [(context - 1, 1)],
                num_q_heads=heads[0],
                num_kv_heads=heads[1],
                head_dim=heads[2],
                block_size=16,
                dtype=dtype,
                device=device,
            )
            if cache_dtype is not None:
                batch.key_cache = kv_quant.encode(batch.key_cache.float(), cache_dtype)
                batch.value_cache = kv_quant.encode(batch.value_cache.float(), cache_dtype)
            out = ops.paged_attention(*batch.args(), **batch.hints())
            args_ref = list(batch.args())
            args_ref[0] = batch.query.float()
            args_ref[1] = kv_quant.dequantize(batch.key_cache)
            args_ref[2] = kv_quant.dequantize(batch.value_cache)
            expected = reference.paged_attention(*args_ref)
            good = torch.allclose(out.float(), expected, **TOLERANCES[dtype])
            ok &= good
            ms = time_ms(
                lambda b=batch: ops.paged_attention(*b.args(), **b.hints()), args.iters, device
            )
            base = base or ms
            print(f"| {context:,} | {name} | {ms * 1e3:.1f} | {ms / base:.2f}x | {good} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
