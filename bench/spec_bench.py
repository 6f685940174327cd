"""Speculative decoding on the CPU (n-gram, draft model or EAGLE-3) against none, in the same
run.

The model is a benchmark fixture, not a product model: a tiny Llama trained on the CPU on
text whose second half repeats spans of its first (``bench.common.trained``; written once
under ``--fixture-dir`` and reused), so that it has learnt to copy, as real models do when
they edit code or summarise. A random model accepts drafts only by accident. By default the
target is that model grown 8 times larger without changing what it computes (``--target
large``, 19 M parameters), so that a batch-1 step is bound by reading its weights, as with
real models; the draft model is the fixture's 0.4 M one.

The workload is copy-heavy: each prompt is a passage followed by the start of its repeat
(``copy_prompts``), greedy, ``ignore_eos``, ``--max-tokens`` each. For each batch size B,
``--requests-per-batch`` x B requests are submitted at once with ``max_num_seqs`` = B, so
that B run at a time and a finished one's place is taken at the next step, as on a server
at concurrency B (with one set of B, its wall time is its slowest sequence's: one that
leaves the passage early decodes a token a step while the rest wait done). The same
requests run with speculation off and on (``--speculative-config``, vLLM's JSON),
interleaved, ``--repeats`` times each:

- output tok/s (median over the repeats, wall clock of the whole set) and the ratio on/off;
- mean acceptance length (1 + accepted drafts per verifying step) and acceptance rate;
- target forwards per output token of one sequence: steps x batch / output tokens (1.0
  without speculation, more where the batch is not full: the run's tail).

The greedy tokens must be identical with and without speculation: exit status 1 otherwise.
Usage: ``python -m bench.spec_bench [--batches 1,4,16,64] [--repeats 3] [--threads N]
[--draft-model K | --eagle3 K [--eagle3-ceiling]]`` (``--draft-model K``: the fixture's draft
model drafts K tokens a step; ``--eagle3 K``: an EAGLE-3 head, trained for the fixture's target
once and cached beside it, drafts K; with ``--eagle3-ceiling``, a head trained on the target's
own outputs for this run's prompts instead: the machinery's ceiling, not a head's quality).
With ``--compare-async`` both systems speculate, without and with ``--async-scheduling``
(the next step planned for the most drafts before this step's forward), over a block manager
in its own process, as in ``pagedserve serve``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.common.eagle3 import write_eagle3_fixture, write_workload_head
from bench.common.engines import EngineSystem, greedy, run_requests
from bench.common.trained import (
    copy_prompts,
    ordinary_vocab,
    write_large_target,
    write_spec_fixture,
)
from pagedserve.testing.procs import ServiceProcess
from services.executor.api import ExecutorConfig, available_cores

DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 3,
}


def _config(
    model: Path,
    batch: int,
    threads: int,
    spec: str | None,
    device: str = "cpu",
    async_scheduling: bool = False,
) -> ExecutorConfig:
    return ExecutorConfig(
        model=str(model),
        dtype="float32",
        device=device,
        cpu_threads=threads,
        num_kv_blocks=4096,
        max_num_seqs=batch,
        max_model_len=512,
        speculative_config=spec,
        async_scheduling=async_scheduling,
    )


def _measure(
    model: Path,
    prompts: list[list[int]],
    args: argparse.Namespace,
    spec: str | None,
    batch: int,
    async_scheduling: bool = False,
) -> tuple[list[float], dict[str, list[int]], dict[str, float]]:
    """Repeated runs of one system (``batch`` sequences at once): tok/s of each, the tokens,
    and the counters of the last. The block manager is ``args.blockmgr``'s, if any."""
    config = _config(model, batch, args.threads, spec, args.device, async_scheduling)
    system = EngineSystem(config, args.blockmgr)
    requests = [(f"r{i}", p, greedy(args.max_tokens)) for i, p in enumerate(prompts)]
    rates: list[float] = []
    tokens: dict[str, list[int]] = {}
    counters: dict[str, float] = {}
    for _ in range(args.repeats):
        with system.engine() as engine:
            run = run_requests(engine, requests)
            stats = engine.stats()
        rates.append(run.num_output_tokens / run.wall_s)
        tokens = run.tokens
        counters = {
            "forwards_per_token": stats.num_steps * batch / run.num_output_tokens,
            "acceptance_length": stats.mean_acceptance_length,
            "acceptance_rate": stats.num_spec_accepted_tokens / max(1, stats.num_spec_draft_tokens),
        }
    return rates, tokens, counters


def _batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.batches.split(",")]


def _prompts(args: argparse.Namespace, batch: int) -> list[list[int]]:
    """The copy-heavy prompts of a batch's run: ``--requests-per-batch`` times the batch (the
    same for a given seed)."""
    num = batch * args.requests_per_batch
    return copy_prompts(args.seed + batch, num, args.prompt_len, ordinary_vocab())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=72)
    p.add_argument(
        "--requests-per-batch",
        type=int,
        default=4,
        metavar="R",
        help="R x batch requests per run, batch of them running at once (1: one set, its "
        "wall time its slowest sequence's)",
    )
    p.add_argument("--threads", type=int, default=available_cores())
    p.add_argument("--fixture-dir", default="models/spec-fixture")
    p.add_argument("--model", default=None, help="a trained checkpoint instead of the fixture's")
    p.add_argument(
        "--target",
        choices=("large", "small"),
        default=None,
        help="the fixture's target: large (19 M, grown from small: bound by reading its "
        "weights, as a real model's decode is; the default) or small (the trained 2.5 M, "
        "which fits in cache; the default with --eagle3, whose heads read its hidden states)",
    )
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    p.add_argument(
        "--draft-model",
        type=int,
        metavar="K",
        default=0,
        help="speculate with the fixture's draft model, K tokens a step, instead of "
        "--speculative-config",
    )
    p.add_argument(
        "--eagle3",
        type=int,
        metavar="K",
        default=0,
        help="speculate with an EAGLE-3 head trained for the fixture's target, K tokens a step",
    )
    p.add_argument(
        "--eagle3-ceiling",
        action="store_true",
        help="with --eagle3: a head trained on the target's own outputs for this run's prompts "
        "instead (nearly every draft accepted: the machinery's ceiling, not a head's quality)",
    )
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="set the speculative config's disable_by_batch_size (no drafts from N sequences)",
    )
    p.add_argument(
        "--compare-async",
        action="store_true",
        help="speculation on without and with --async-scheduling (instead of off and on), the "
        "block manager in its own process over gRPC, as in `pagedserve serve`",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cuda: the GPU session's timing")
    args = p.parse_args()
    args.blockmgr = None
    if not args.compare_async:
        return _run(args, p)
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    try:
        args.blockmgr = blockmgr.address
        return _run(args, p)
    finally:
        blockmgr.stop()


def _run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if args.model:
        target = Path(args.model)
    else:
        target, draft = write_spec_fixture(Path(args.fixture_dir), seed=args.seed)
        if args.eagle3 and args.target == "large":
            p.error("--eagle3: the heads are trained for the small target (--target small)")
        if (args.target or ("small" if args.eagle3 else "large")) == "large":
            target = write_large_target(Path(args.fixture_dir) / "large", target, args.seed)
        if args.draft_model:
            spec = {"model": str(draft), "num_speculative_tokens": args.draft_model}
            args.speculative_config = json.dumps(spec)
        if args.eagle3:
            head = write_eagle3_fixture(Path(args.fixture_dir) / "eagle3", target, seed=args.seed)
            if args.eagle3_ceiling:
                # (the default batches' prompts too: one cached head serves any --batches)
                batches = sorted({1, 4, 16, 64, *_batches(args)})
                prompts = [p for b in batches for p in _prompts(args, b)]
                head = write_workload_head(
                    Path(args.fixture_dir) / "eagle3-workload",
                    target,
                    prompts,
                    args.max_tokens,
                    seed=args.seed,
                )
            spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.eagle3}
            args.speculative_config = json.dumps(spec)
    if args.disable_by_batch_size is not None:
        spec = {**json.loads(args.speculative_config)}
        spec["disable_by_batch_size"] = args.disable_by_batch_size
        args.speculative_config = json.dumps(spec)
    where = f"CPU, {args.threads} threads" if args.device == "cpu" else args.device
    print(f"# Speculative decoding ({where}), `{args.speculative_config}`\n")
    off_name, on_name = ("sync", "async") if args.compare_async else ("off", "on")
    if args.compare_async:
        print("Speculation on in both; the block manager in its own process (gRPC).\n")
    print(
        f"| batch | {off_name} tok/s | {on_name} tok/s | {on_name}/{off_name} "
        f"| acceptance length | acceptance rate | forwards/token {on_name} |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    mismatches = 0
    for batch in _batches(args):
        prompts = _prompts(args, batch)
        off_rates: list[float] = []
        on_rates: list[float] = []
        for _ in range(2):  # interleaved halves: the machine's drift hits both alike
            half = argparse.Namespace(**{**vars(args), "repeats": max(1, args.repeats // 2)})
            spec = args.speculative_config
            baseline = spec if args.compare_async else None
            rates, off_tokens, _ = _measure(target, prompts, half, baseline, batch)
            off_rates += rates
            rates, on_tokens, counters = _measure(
                target, prompts, half, spec, batch, async_scheduling=args.compare_async
            )
            on_rates += rates
            mismatches += sum(on_tokens[r] != off_tokens[r] for r in off_tokens)
        off, on = statistics.median(off_rates), statistics.median(on_rates)
        print(
            f"| {batch} | {off:.0f} | {on:.0f} | {on / off:.2f}x "
            f"| {counters['acceptance_length']:.2f} | {counters['acceptance_rate']:.2f} "
            f"| {counters['forwards_per_token']:.2f} |",
            flush=True,
        )
    if mismatches:
        print(f"\n{mismatches} outputs differ ({off_name} / {on_name})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
