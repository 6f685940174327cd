"""Tensor parallelism: the step time of one model at TP=1 and TP=N, and what the collectives
cost per step.

The model is a random Llama whose matmuls dominate the step (by default hidden 1024, MLP
4096, 16 heads, 4 layers, ~70 M parameters, fp32), written once as a real checkpoint. Each
TP size builds the production runner (``build_runner``: rank 0 here, the other
ranks spawned processes) and times, over ``--repeats`` runs each:

- a prefill step: ``--batch`` sequences of ``--prompt-len`` tokens;
- a decode step: ``--batch`` sequences of one token at context ``--prompt-len``.

Rank 0's wall time inside the collectives (all-reduce, logits gather) is reported per step
on the CPU (gloo). On CUDA (NCCL, one GPU per rank) the collectives are asynchronous, so
only step times are reported. Every rank gets ``--threads-per-rank`` torch threads
(default: the cores divided by the largest TP size, so TP=N is not oversubscribed); TP=1 is
also run with all the cores, the fair baseline on a CPU.

    .venv/bin/python -m bench.internals.tp_bench [--sizes 1,2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.tools.tiny_model import write_tiny_model
from services.common.logging import configure_logging
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.launch import build_runner
from services.executor.model.parallel import DistComm
from services.executor.model.runner import ModelRunner
from services.executor.service.config import ExecutorConfig


def _steps(runner: ModelRunner, batch: int, prompt_len: int, block_size: int):
    blocks_per_seq = -(-(prompt_len + 1) // block_size)
    tables = [
        list(range(1 + b * blocks_per_seq, 1 + (b + 1) * blocks_per_seq)) for b in range(batch)
    ]
    prefill = [SeqChunk([3 + (b % 50)] * prompt_len, 0, tables[b], True) for b in range(batch)]
    decode = [SeqChunk([7], prompt_len, tables[b], True) for b in range(batch)]
    return prefill, decode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(runner: ModelRunner, chunks: list[SeqChunk], repeats: int) -> tuple[float, float]:
    """Median step seconds and median collective seconds per step (0 when not measured)."""
    comm = runner.model.comm
    steps, coll = [], []
    runner.execute(chunks)  # warm-up
    for _ in range(repeats):
        c0 = comm.collective_s if isinstance(comm, DistComm) else 0.0
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.execute(chunks)
        _sync(runner.device)
        steps.append(time.perf_counter() - t0)
        c1 = comm.collective_s if isinstance(comm, DistComm) else 0.0
        # NCCL collectives are asynchronous: their host-side wall time means nothing.
        coll.append(c1 - c0 if runner.device.type == "cpu" else float("nan"))
    return statistics.median(steps), statistics.median(coll)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2", help="TP sizes, e.g. 1,2,4")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=4096)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads-per-rank", type=int, default=None)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: write one)")
    args = p.parse_args()
    configure_logging("tp-bench", "WARNING")
    sizes = [int(s) for s in args.sizes.split(",")]
    cores = os.cpu_count() or 1
    threads = args.threads_per_rank or max(1, cores // max(sizes))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned ranks

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(
        write_tiny_model(
            Path(tmp.name) / "tp-bench-llama",
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_heads,
            num_layers=args.num_layers,
            init_std=0.02,
        )
    )
    runs = [(size, threads) for size in sizes]
    if args.device == "cpu" and threads < cores and 1 in sizes:
        runs.insert(sizes.index(1) + 1, (1, cores))
    block_size = 16
    blocks = args.batch * -(-(args.prompt_len + 1) // block_size) + 1
    rows = []
    base: dict[str, float] = {}
    for size, nthreads in runs:
        torch.set_num_threads(nthreads)
        config = ExecutorConfig(
            model=model,
            device=args.device,
            dtype="float32" if args.device == "cpu" else "bfloat16",
            num_kv_blocks=blocks,
            max_model_len=args.prompt_len + 16,
            max_num_batched_tokens=args.batch * args.prompt_len,
            tensor_parallel_size=size,
            enforce_eager=True,
            log_level="WARNING",
        )
        runner = build_runner(config.runner_config())
        try:
            prefill, decode = _steps(runner, args.batch, args.prompt_len, block_size)
            pf, pf_coll = _time(runner, prefill, max(3, args.repeats // 3))
            dc, dc_coll = _time(runner, decode, args.repeats)
        finally:
            runner.close()
        if size == 1 and nthreads == threads:
            base = {"prefill": pf, "decode": dc}
        rows.append((size, nthreads, pf, pf_coll, dc, dc_coll, base))
        del runner

    params = sum(
        4 * args.hidden_size * args.hidden_size + 3 * args.hidden_size * args.intermediate_size
        for _ in range(args.num_layers)
    )
    print(
        f"\nmodel: hidden {args.hidden_size}, MLP {args.intermediate_size}, "
        f"{args.num_heads} heads, {args.num_layers} layers (~{params / 1e6:.0f} M layer "
        f"params), batch {args.batch}, prompt {args.prompt_len}, device {args.device}, "
        f"{cores} cores\n"
    )
    print(
        "| TP | threads/rank | prefill step (ms) | collectives (ms) | decode step (ms) "
        "| collectives (ms) | prefill vs TP=1 | decode vs TP=1 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, nthreads, pf, pf_coll, dc, dc_coll, b in rows:
        ratio_pf = b["prefill"] / pf if b else float("nan")
        ratio_dc = b["decode"] / dc if b else float("nan")
        print(
            f"| {size} | {nthreads} | {pf * 1e3:.1f} | {pf_coll * 1e3:.2f} | {dc * 1e3:.2f} "
            f"| {dc_coll * 1e3:.2f} | {ratio_pf:.2f}x | {ratio_dc:.2f}x |"
        )
    print(
        f"\nCollectives per forward: {2 * args.num_layers} all-reduces (o_proj, down_proj per "
        "layer) + 1 embedding all-reduce + 1 logits gather; 'vs TP=1' is the speed-up over "
        f"TP=1 at {threads} thread(s)."
    )


if __name__ == "__main__":
    main()
