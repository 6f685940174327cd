"""Decode step time with and without ``--async-scheduling``, in one run.

Set-up: the host-bench engine (the real scheduler, block-manager link, batch build, sampler
and output building; a null model with random logits over 128 tokens), 256 running sequences
in pure decode, prompts of 300 tokens, over the block manager as a real separate process
(gRPC on loopback, as in compose and Kubernetes) and in-process. The forward is modelled as
on a GPU: the real batch is built and "launched", the call returns at once, and the device
stays busy ``--forward-ms``; the sampler's first read of the logits waits for it (GIL free,
as a CUDA synchronisation). Host work between the launch and that read (with async
scheduling: the next Step's round trip, its answer, the next batch's build) overlaps the
device; 0 ms shows the pure host cost.

Each configuration runs ``--steps`` timed decode steps after a warm-up, configurations
interleaved ``--rounds`` times; the figure is the median of the per-round medians.

    .venv/bin/python -m bench.internals.async_bench [--forward-ms 0,3.5] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch

from bench.internals.host_bench import VOCAB, NullRunner
from pagedserve.testing.procs import ServiceProcess
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import PoolSpec
from services.blockmgr.client import GrpcClient, InProcessClient
from services.common.gc_policy import freeze_startup_heap
from services.common.sampling_params import SamplingParams
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings
from services.executor.core.engine import Engine
from services.executor.core.sampler import Sampler
from services.executor.core.scheduler import SchedulerConfig
from services.executor.core.sequence import RequestKey
from services.executor.model.forward_batch import PreparedForward


class DeviceRunner(NullRunner):
    """The null runner with a model of a GPU: ``launch`` returns at once and the device is
    busy ``forward_s`` from then; the first read of the logits (the sampler's copy to the
    host) waits for it, GIL free, as a CUDA synchronisation does."""

    launch_returns_early = True

    def __init__(self, forward_s: float, *args: int) -> None:
        super().__init__(*args)
        self.forward_s = forward_s
        self.ready_at = 0.0

    def launch(self, prepared: PreparedForward) -> torch.Tensor:
        logits = super().launch(prepared)
        self.ready_at = time.perf_counter() + self.forward_s
        return logits

    def wait(self) -> None:
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class SyncingSampler:
    """The engine's sampler, reading the logits only once the device is done."""

    def __init__(self, sampler: Sampler, device: DeviceRunner) -> None:
        self.sampler, self.device = sampler, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.device.wait()
        return self.sampler(*args, **kwargs)


def decode_steps(
    client: BlockManagerClient,
    *,
    pool_id: str,
    async_scheduling: bool,
    forward_s: float,
    num_seqs: int,
    prompt_len: int,
    steps: int,
) -> tuple[float, float]:
    """(p50 step ms, share of steps whose Step was sent ahead) over ``steps`` decode steps."""
    bs = 16
    max_model_len = prompt_len + steps + 64
    num_blocks = num_seqs * -(-max_model_len // bs) + 2
    runner = DeviceRunner(forward_s, num_blocks, bs, max_model_len)
    settings = EngineSettings(
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        scheduler=SchedulerConfig(
            block_size=bs,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, prompt_len),
            watermark_blocks=0,
        ),
        async_scheduling=async_scheduling,
    )
    link = BlockManagerLink(client, pool_id, PoolSpec(num_blocks, bs, True))
    engine = Engine(settings, runner, link)
    engine.sampler = SyncingSampler(engine.sampler, runner)  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=10**6 // 2, ignore_eos=True)
    for i in range(num_seqs):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist()
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.prompt_len for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(20):
        engine.step()
    freeze_startup_heap()  # as every service does once it has started
    ahead0 = engine.num_steps_ahead
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == num_seqs
    ahead = (engine.num_steps_ahead - ahead0) / steps
    link.unregister()
    return statistics.median(times) * 1e3, ahead


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--forward-ms",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 3.5],
        help="comma-separated device times of the forward to model",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    grpc_client = GrpcClient(blockmgr.address)
    results: dict[tuple[str, float, bool], list[float]] = {}
    ahead: dict[tuple[str, float, bool], float] = {}
    try:
        n = 0
        for _ in range(args.rounds):
            for forward_ms in args.forward_ms:
                for transport in ("grpc", "inproc"):
                    for async_scheduling in (False, True):
                        n += 1
                        key = (transport, forward_ms, async_scheduling)
                        client = grpc_client if transport == "grpc" else InProcessClient()
                        ms, share = decode_steps(
                            client,
                            pool_id=f"async-bench-{n}",
                            async_scheduling=async_scheduling,
                            forward_s=forward_ms / 1e3,
                            num_seqs=args.num_seqs,
                            prompt_len=args.prompt_len,
                            steps=args.steps,
                        )
                        results.setdefault(key, []).append(ms)
                        ahead[key] = share
    finally:
        grpc_client.close()
        blockmgr.stop()
    print(
        f"decode step p50, {args.num_seqs} seqs, prompts {args.prompt_len}, "
        f"{args.steps} steps x {args.rounds} rounds (median of round medians)"
    )
    print("| block manager | forward (device wait) | sync | async | steps sent ahead | saved |")
    print("|---|---:|---:|---:|---:|---:|")
    for forward_ms in args.forward_ms:
        for transport in ("grpc", "inproc"):
            sync = statistics.median(results[(transport, forward_ms, False)])
            fast = statistics.median(results[(transport, forward_ms, True)])
            share = ahead[(transport, forward_ms, True)]
            print(
                f"| {transport} | {forward_ms:.1f} ms | {sync:.3f} ms | {fast:.3f} ms | "
                f"{share:.0%} | {sync - fast:+.3f} ms ({sync / fast:.2f}x) |"
            )


if __name__ == "__main__":
    main()
