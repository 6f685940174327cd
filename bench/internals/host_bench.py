"""Host work per engine step on the CPU: the cost of everything around the model.

Set-up (issue 9): a null model that returns random logits over a 128-token vocabulary, so the
sampling arithmetic is negligible; the in-process block manager; 256 running sequences in pure
decode, prompts of 300 tokens. The runner still builds the real forward batch (the same code
the model runner uses), so the figure covers planning + block-manager Step + batch build +
sampling + output building: ``Engine.step()`` wall time, minus nothing.

    .venv/bin/python -m bench.internals.host_bench [--num-seqs 256] [--prompt-len 300] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch

from bench.common.stats import percentile
from services.blockmgr.api.types import PoolSpec
from services.blockmgr.client import InProcessClient
from services.common.gc_policy import freeze_startup_heap
from services.common.sampling_params import SamplingParams
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings
from services.executor.core.engine import Engine
from services.executor.core.scheduler import SchedulerConfig
from services.executor.core.sequence import RequestKey
from services.executor.model.forward_batch import BatchBuilder, PreparedForward, SeqChunk

VOCAB = 128


class NullRunner:
    """Builds the real forward batch, then answers random logits instead of running a model.

    The logits come from a bank drawn once (generating 256 x 128 normals costs 80 us a step,
    which is the stand-in model's work, not host work of the engine)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.builder = BatchBuilder(
            block_size,
            self.device,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            vocab_size=VOCAB,
        )
        gen = torch.Generator().manual_seed(0)
        self.bank = torch.randn(16, 1024, VOCAB, generator=gen)
        self.turn = 0

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        return self.launch(self.prepare(chunks))

    def prepare(self, chunks: Sequence[SeqChunk]) -> PreparedForward:
        return self.builder.prepare(chunks)

    def launch(self, prepared: PreparedForward) -> torch.Tensor:
        batch = self.builder.upload(prepared.host)
        self.turn = (self.turn + 1) % len(self.bank)
        rows = batch.logits_indices.shape[0]
        if rows > self.bank.shape[1]:
            return torch.randn(rows, VOCAB)
        return self.bank[self.turn, :rows]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--steps", type=int, default=300, help="timed decode steps")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--gc-defaults",
        action="store_true",
        help="keep CPython's collector settings (no services.common.gc_policy)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)

    max_model_len = args.prompt_len + args.steps + 64
    blocks_per_seq = -(-max_model_len // args.block_size)
    num_blocks = args.num_seqs * blocks_per_seq + 2
    runner = NullRunner(num_blocks, args.block_size, max_model_len)
    settings = EngineSettings(
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        scheduler=SchedulerConfig(
            block_size=args.block_size,
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=max(2048, args.prompt_len),
            watermark_blocks=0,
        ),
    )
    link = BlockManagerLink(
        InProcessClient(), "host-bench", PoolSpec(num_blocks, args.block_size, True)
    )
    engine = Engine(settings, runner, link)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=args.temperature, max_tokens=10**6 // 2, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = torch.randint(3, VOCAB, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    while any(s.num_computed_tokens < s.prompt_len for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill everything
    for _ in range(20):  # warm-up decode steps
        engine.step()
    if not args.gc_defaults:
        freeze_startup_heap()  # as every service does once it has started
    assert len(engine.scheduler.running) == args.num_seqs
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == args.num_seqs
    p50 = statistics.median(times) * 1e3
    p99 = percentile(times, 0.99) * 1e3
    mean = statistics.fmean(times) * 1e3
    print(
        f"host work per decode step, {args.num_seqs} seqs, prompts {args.prompt_len}, "
        f"temperature {args.temperature}: p50 {p50:.3f} ms, mean {mean:.3f} ms, "
        f"p99 {p99:.3f} ms ({args.steps} steps)"
    )


if __name__ == "__main__":
    main()
