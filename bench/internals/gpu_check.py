"""GPU check of the KV-cache kernels: correctness on CUDA, then bandwidth tables.

    python -m bench.internals.gpu_check [--iters N] [--no-bench] [--cpu-dry-run]

1. Correctness: every Triton kernel against the torch reference in bf16 and fp16 (and
   fp32 for the pairwise cases), on CUDA; one ``PASS``/``FAIL`` line per check with its
   max abs error. At benchmark scale the paged kernels are also checked against SDPA on
   the contiguous cache (this is where block ids push offsets past 2^31 elements).
2. Decode attention, Llama-3-8B heads (32 q / 8 kv heads, head_dim 128, block size 16,
   bf16), batch 1/16/64/256 x context 1k/4k/16k, unified and split-KV kernels:
   achieved bandwidth (K/V + Q + out bytes / time) as a share of a measured
   device-to-device copy, and the paged time against torch SDPA on a contiguous
   ``[B, Hkv, S, D]`` cache. The contiguous baseline folds each GQA group into the
   query-length axis (``q: [B, Hkv, G, D]``), which is exact for decode and reads K/V
   once, as the paged kernels do. Then ``reshape_and_cache`` bandwidth.

Timing: CUDA events around each call, 3 warm-up calls, median of ``--iters``; a 1 GiB
buffer is zeroed before every timed call so nothing is served from L2 (and so the CPU
has time to enqueue the call before the GPU reaches it). Configs that do not fit in free
memory are skipped. Exit status 1 if any correctness check fails; 0 without CUDA.

``--cpu-dry-run`` runs every step of the script on CPU under the Triton interpreter with
tiny shapes and fp16 in place of bf16 (timings meaningless): it proves the script itself
before it meets a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from pagedserve.kernels import ops, reference
from pagedserve.kernels.testing import (
    MIXED_BATCH,
    PAIRWISE_CASES,
    TOLERANCES,
    KernelCase,
    PagedBatch,
    make_paged_batch,
)

GIB = 1 << 30
# Llama-3-8B attention shapes.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TARGET_BATCH, TARGET_CONTEXT = 64, 4096
TARGET_COPY_SHARE, TARGET_PAGED_OVER_CONTIG = 0.75, 1.05


@dataclass(frozen=True)
class Plan:
    """What to run where: the real GPU plan, or the tiny CPU dry run."""

    device: str
    dtypes: tuple[torch.dtype, ...]  # correctness dtypes; the first one is benchmarked
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    context_divisor: int  # shrinks the Llama-shaped correctness batches
    max_cases: int  # pairwise cases per dtype
    split_counts: tuple[int, int]  # num_splits of the two split-KV correctness runs
    extended: bool  # also head_dim 256 / 80 cases and the Llama-shaped mixed batch
    reshape_tokens: tuple[int, ...]
    reshape_blocks: int
    copy_bytes: int
    flush_bytes: int

    @property
    def bench_dtype(self) -> torch.dtype:
        return self.dtypes[0]

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


CUDA_PLAN = Plan(
    device="cuda",
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    batches=(1, 16, 64, 256),
    contexts=(1024, 4096, 16384),
    context_divisor=1,
    max_cases=len(PAIRWISE_CASES),
    split_counts=(4, 16),
    extended=True,
    reshape_tokens=(256, 8192),
    reshape_blocks=65536,  # 1M slots: 2 GiB each for K and V
    copy_bytes=4 * GIB,
    flush_bytes=GIB,
)
CPU_DRY_RUN_PLAN = Plan(
    device="cpu",
    dtypes=(torch.float16,),  # bf16 is not faithful in the interpreter
    batches=(1, 2),
    contexts=(64,),
    context_divisor=64,
    max_cases=1,
    split_counts=(2, 3),
    extended=False,
    reshape_tokens=(8,),
    reshape_blocks=64,
    copy_bytes=1 << 20,
    flush_bytes=1 << 20,
)


@dataclass
class Report:
    """Correctness results; any failure makes the script exit 1."""

    failures: list[str] = field(default_factory=list)
    num_checks: int = 0

    def close(
        self, name: str, out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype
    ) -> None:
        if out.shape != expected.shape:
            self._record(name, False, f"shape {tuple(out.shape)} != {tuple(expected.shape)}")
            return
        out32, exp32 = out.float(), expected.float()
        err = (out32 - exp32).abs().max().item() if out.numel() else 0.0
        finite = bool(torch.isfinite(out32).all())
        ok = finite and torch.allclose(out32, exp32, **TOLERANCES[dtype])
        self._record(name, ok, f"max_err={err:.3g}" + ("" if finite else " NON-FINITE"))

    def equal(self, name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
        err = (out.float() - expected.float()).abs().max().item() if out.numel() else 0.0
        self._record(name, torch.equal(out, expected), f"max_err={err:.3g}")

    def error(self, name: str, exc: BaseException) -> None:
        self._record(name, False, f"raised {type(exc).__name__}: {exc}")

    def _record(self, name: str, ok: bool, detail: str) -> None:
        self.num_checks += 1
        print(f"{'PASS' if ok else 'FAIL'}  {name:<64} {detail}", flush=True)
        if not ok:
            self.failures.append(name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------- correctness


def _check_attention(report: Report, plan: Plan, name: str, batch: PagedBatch) -> None:
    from pagedserve.kernels.paged_attention import paged_attention_triton
    from pagedserve.kernels.paged_attention_split_kv import paged_attention_split_kv_triton

    dtype = batch.query.dtype
    expected = reference.paged_attention(*batch.args())
    few, many = plan.split_counts
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "unified": lambda: paged_attention_triton(*batch.args(), **batch.hints()),
        "unified/no-hints": lambda: paged_attention_triton(*batch.args()),
        f"split{few}": lambda: paged_attention_split_kv_triton(
            *batch.args(), num_splits=few, **batch.hints()
        ),
        f"split{many}/no-hints": lambda: paged_attention_split_kv_triton(
            *batch.args(), num_splits=many
        ),
        "ops": lambda: ops.paged_attention(*batch.args(), **batch.hints()),
    }
    for run_name, run in runs.items():
        label = f"attention {run_name} {name} {_dtype_name(dtype)}"
        try:
            report.close(label, run(), expected, dtype)
        except Exception as exc:  # report and go on: one bad config must not hide others
            report.error(label, exc)


def _check_cache_ops(report: Report, plan: Plan, dtype: torch.dtype) -> None:
    from pagedserve.kernels.copy_blocks import copy_blocks_triton
    from pagedserve.kernels.reshape_and_cache import reshape_and_cache_triton

    dev = plan.device
    # reshape_and_cache: scattered slots, padding slots, strided K/V from a fused QKV.
    num_blocks, num_tokens = 64, 257
    qkv = torch.randn(num_tokens, NUM_Q_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, device=dev)
    qkv = qkv.to(dtype)
    key = qkv[:, NUM_Q_HEADS : NUM_Q_HEADS + NUM_KV_HEADS]
    value = qkv[:, NUM_Q_HEADS + NUM_KV_HEADS :]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:num_tokens]
    slots[::7] = -1
    kv_cache = torch.randn(2, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=dev)
    kv_cache = kv_cache.to(dtype)
    expected = kv_cache.clone()
    reference.reshape_and_cache(key, value, expected[1, 0], expected[1, 1], slots)
    label = f"reshape_and_cache {_dtype_name(dtype)}"
    try:
        reshape_and_cache_triton(key, value, kv_cache[1, 0], kv_cache[1, 1], slots)
        report.equal(label, kv_cache, expected)
    except Exception as exc:
        report.error(label, exc)

    # copy_blocks over 4 layers, one source forked twice.
    kv_cache = torch.randn(4, 2, 32, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=dev).to(dtype)
    src = torch.tensor([3, 9, 9, 30], device=dev)
    dst = torch.tensor([1, 20, 21, 5], device=dev)
    expected = kv_cache.clone()
    reference.copy_blocks(expected, src, dst)
    label = f"copy_blocks {_dtype_name(dtype)}"
    try:
        copy_blocks_triton(kv_cache, src, dst)
        report.equal(label, kv_cache, expected)
    except Exception as exc:
        report.error(label, exc)


def check_correctness(report: Report, plan: Plan) -> None:
    div = plan.context_divisor
    llama_batches = {
        # fresh prefill, decodes, prefill after a cached prefix, chunk, off block boundaries
        "llama-mixed": (
            (0, 300 // div),
            (1000 // div, 1),
            (2047 // div, 1),
            (513 // div, 200 // div),
            (4000 // div, 64 // div),
            (15, 1),
        ),
        "llama-decode": ((3000 // div, 1), (17, 1), (2500 // div, 1), (4095 // div, 1)),
    }
    for dtype in plan.dtypes:
        if dtype == torch.float32:  # exact-fp32 dots: the pairwise fp32 cases only
            cases = [c for c in PAIRWISE_CASES if c.dtype == torch.float32]
        else:
            cases = [replace(c, dtype=dtype) for c in PAIRWISE_CASES]
        cases = cases[: plan.max_cases]
        if dtype == plan.bench_dtype and plan.extended:
            # head_dim 256 (largest tiles, shared-memory budget) and 80 (masked lanes).
            cases += [KernelCase(8, 1, 256, 16, dtype), KernelCase(4, 2, 80, 32, dtype)]
        for case in cases:
            batch = make_paged_batch(
                MIXED_BATCH,
                num_q_heads=case.num_q_heads,
                num_kv_heads=case.num_kv_heads,
                head_dim=case.head_dim,
                block_size=case.block_size,
                dtype=dtype,
                device=plan.device,
                num_pad_tokens=3,
            )
            _check_attention(report, plan, case.id.rsplit("-", 1)[0], batch)
        if dtype == torch.float32:
            continue
        for name, seqs in llama_batches.items():
            if name == "llama-mixed" and not plan.extended:
                continue
            batch = make_paged_batch(
                seqs,
                num_q_heads=NUM_Q_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE,
                dtype=dtype,
                device=plan.device,
                num_pad_tokens=5,
            )
            _check_attention(report, plan, name, batch)
        _check_cache_ops(report, plan, dtype)
    plan.sync()


# --------------------------------------------------------------------------- benchmark


class Timer:
    """Median time of a call in microseconds: CUDA events, L2 flushed before each call."""

    def __init__(self, plan: Plan, iters: int) -> None:
        self.plan = plan
        self.iters = iters
        self.flush = torch.empty(plan.flush_bytes, dtype=torch.uint8, device=plan.device)

    def __call__(self, fn: Callable[[], object], flush: bool = True) -> float:
        if self.plan.device != "cuda":  # dry run: wall clock, meaningless but exercised
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(self.iters):
            if flush:
                self.flush.zero_()  # evicts L2; also lets the CPU run ahead of the GPU
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            fn()
            end_event.record()
            events.append((start_event, end_event))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events)


def copy_bandwidth(timer: Timer, plan: Plan) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src), flush=False)
    return 2 * plan.copy_bytes / (us * 1e-6)


@dataclass
class DecodeRow:
    batch: int
    context: int
    kernel: str
    num_splits: int
    chosen: bool  # what ops.paged_attention would run
    us: float
    bytes_moved: int
    contig_us: float


def bench_decode_config(
    timer: Timer, report: Report, plan: Plan, batch: int, context: int, num_sms: int
) -> list[DecodeRow]:
    from pagedserve.kernels.paged_attention import paged_attention_triton
    from pagedserve.kernels.paged_attention_split_kv import paged_attention_split_kv_triton

    dtype, dev = plan.bench_dtype, plan.device
    group = NUM_Q_HEADS // NUM_KV_HEADS
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    # Contiguous K/V (baseline), scattered into shuffled cache blocks (paged).
    physical = torch.randperm(num_blocks - 1, device=dev) + 1
    block_tables = physical.view(batch, blocks_per_seq).to(torch.int32)
    caches: list[torch.Tensor] = []
    contiguous: list[torch.Tensor] = []
    for _ in range(2):  # K, then V
        dense = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=dev, dtype=dtype)
        cache = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
        cache[0].zero_()
        by_block = dense.view(batch, NUM_KV_HEADS, blocks_per_seq, BLOCK_SIZE, HEAD_DIM)
        token_major = by_block.permute(0, 2, 3, 1, 4)  # [B, nblk, BS, Hkv, D]
        cache[physical] = token_major.reshape(-1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        caches.append(cache)
        contiguous.append(dense)
    key_cache, value_cache = caches
    k_dense, v_dense = contiguous
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    query_start_loc = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    args = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    hints = {"max_query_len": 1, "max_seq_len": context}
    chosen_splits = ops.split_kv_heuristic(batch, NUM_KV_HEADS, 1, context, num_sms)
    split_splits = chosen_splits if chosen_splits > 1 else 4

    def contiguous_sdpa() -> torch.Tensor:
        q = query.view(batch, NUM_KV_HEADS, group, HEAD_DIM)  # GQA group folded into q_len
        return F.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale)

    def unified() -> torch.Tensor:
        return paged_attention_triton(*args, **hints)

    def split() -> torch.Tensor:
        return paged_attention_split_kv_triton(*args, num_splits=split_splits, **hints)

    truth = contiguous_sdpa().reshape(batch, NUM_Q_HEADS, HEAD_DIM)
    tag = f"b{batch} ctx{context}"
    report.close(f"decode unified vs contiguous SDPA {tag}", unified(), truth, dtype)
    report.close(f"decode split{split_splits} vs contiguous SDPA {tag}", split(), truth, dtype)

    contig_us = timer(contiguous_sdpa)
    bytes_moved = (
        2 * batch * context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize  # K and V
        + 2 * batch * NUM_Q_HEADS * HEAD_DIM * dtype.itemsize  # Q read, out written
    )
    return [
        DecodeRow(
            batch, context, "unified", 1, chosen_splits == 1, timer(unified), bytes_moved, contig_us
        ),
        DecodeRow(
            batch,
            context,
            "split-KV",
            split_splits,
            chosen_splits > 1,
            timer(split),
            bytes_moved,
            contig_us,
        ),
    ]


def bench_reshape_and_cache(timer: Timer, plan: Plan, copy_bw: float) -> list[str]:
    from pagedserve.kernels.reshape_and_cache import reshape_and_cache_triton

    dtype, dev = plan.bench_dtype, plan.device
    num_blocks = plan.reshape_blocks
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.empty(cache_shape, device=dev, dtype=dtype)
    value_cache = torch.empty_like(key_cache)
    lines = []
    for num_tokens in plan.reshape_tokens:
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:num_tokens]

        def write(k: torch.Tensor = key, v: torch.Tensor = value, s: torch.Tensor = slots) -> None:
            reshape_and_cache_triton(k, v, key_cache, value_cache, s)

        us = timer(write)
        nbytes = 2 * 2 * key.numel() * dtype.itemsize + slots.numel() * 8
        bw = nbytes / (us * 1e-6)
        lines.append(
            f"| {num_tokens} | {us:.1f} | {nbytes / 1e6:.2f} | {bw / 1e9:.0f} "
            f"| {100 * bw / copy_bw:.0f}% |"
        )
    return lines


def _free_bytes(plan: Plan) -> int:
    if plan.device == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]
    return 1 << 40


def run_benchmarks(report: Report, plan: Plan, iters: int, num_sms: int) -> None:
    timer = Timer(plan, iters)
    copy_bw = copy_bandwidth(timer, plan)
    dtype_name = _dtype_name(plan.bench_dtype)
    print(f"\nDevice-to-device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s\n")
    print(
        f"Decode attention, Llama-3-8B heads (32 q / 8 kv, head_dim 128), block 16, "
        f"{dtype_name}. `*` = the kernel ops.paged_attention picks ({num_sms} SMs).\n"
    )
    print(
        "| batch | ctx | kernel | splits | time (us) | GB/s | % of copy "
        "| SDPA contiguous (us) | paged / contiguous |"
    )
    print("|---:|---:|:---|---:|---:|---:|---:|---:|---:|")
    target_rows: list[DecodeRow] = []
    for context in plan.contexts:
        for batch in plan.batches:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * plan.bench_dtype.itemsize
            need = 2.5 * kv_bytes  # paged + contiguous K/V, plus a K-sized permute temporary
            if need > 0.85 * _free_bytes(plan):
                print(f"| {batch} | {context} | skipped: needs {need / GIB:.1f} GiB | | | | | | |")
                continue
            try:
                rows = bench_decode_config(timer, report, plan, batch, context, num_sms)
            except Exception as exc:
                report.error(f"decode bench b{batch} ctx{context}", exc)
                continue
            for r in rows:
                bw = r.bytes_moved / (r.us * 1e-6)
                print(
                    f"| {r.batch} | {r.context} | {r.kernel}{' *' if r.chosen else ''} | "
                    f"{r.num_splits} | {r.us:.1f} | {bw / 1e9:.0f} | {100 * bw / copy_bw:.0f}% | "
                    f"{r.contig_us:.1f} | {r.us / r.contig_us:.2f} |",
                    flush=True,
                )
                if (r.batch, r.context) == (TARGET_BATCH, TARGET_CONTEXT):
                    target_rows.append(r)
    _free_bytes(plan)

    print(
        f"\nreshape_and_cache, Llama-3-8B KV heads, {dtype_name}, scattered slots "
        "(K/V read + written).\n"
    )
    print("| tokens | time (us) | MB moved | GB/s | % of copy |")
    print("|---:|---:|---:|---:|---:|")
    for line in bench_reshape_and_cache(timer, plan, copy_bw):
        print(line)

    print(f"\nTargets at batch {TARGET_BATCH}, ctx {TARGET_CONTEXT} (reported, not enforced):")
    if not target_rows:
        print("  (not measured in this plan)")
    for r in target_rows:
        share = r.bytes_moved / (r.us * 1e-6) / copy_bw
        ratio = r.us / r.contig_us
        print(
            f"  {r.kernel}{' (dispatched)' if r.chosen else ''}: {100 * share:.0f}% of copy "
            f"bandwidth (target >= {100 * TARGET_COPY_SHARE:.0f}%: "
            f"{'MET' if share >= TARGET_COPY_SHARE else 'MISSED'}); paged/contiguous "
            f"{ratio:.2f} (target <= {TARGET_PAGED_OVER_CONTIG:.2f}: "
            f"{'MET' if ratio <= TARGET_PAGED_OVER_CONTIG else 'MISSED'})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--no-bench", action="store_true", help="correctness checks only")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="exercise the whole script on CPU under the Triton interpreter (tiny shapes)",
    )
    args = parser.parse_args()
    if args.cpu_dry_run:
        # Before anything imports triton (kernels are imported lazily).
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["PAGEDSERVE_FORCE_TRITON"] = "1"
        plan, num_sms = CPU_DRY_RUN_PLAN, 132
        print("CPU dry run under the Triton interpreter: timings are meaningless")
    elif not torch.cuda.is_available():
        print("no CUDA: nothing to check")
        return 0
    else:
        plan = CUDA_PLAN
        props = torch.cuda.get_device_properties(0)
        num_sms = props.multi_processor_count
        print(
            f"{props.name}, {num_sms} SMs, {props.total_memory / GIB:.0f} GiB; "
            f"torch {torch.__version__}"
        )
    torch.manual_seed(0)
    report = Report()
    check_correctness(report, plan)
    if not args.no_bench:
        run_benchmarks(report, plan, args.iters, num_sms)
    print(f"\n{report.num_checks - len(report.failures)}/{report.num_checks} checks passed")
    if report.failures:
        print("FAILED: " + ", ".join(report.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
