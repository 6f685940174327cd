"""Engine benchmark: our continuous-batching engine vs static batching (HF ``generate``).

One run, one tiny random Llama (written to a temporary directory), one fixed seeded set of
requests (varied prompt lengths; varied output lengths fixed with ``ignore_eos`` and
``max_tokens``; greedy). Every request arrives at t=0 (offline throughput). Throughput is
output tokens per second over the wall clock of the whole set, counting only the tokens each
request asked for.

Static batching = transformers ``model.generate()`` on left-padded batches (attention mask,
``do_sample=False``, ``max_new_tokens`` = the batch's largest ``max_tokens``): a batch runs
until its longest member is done, and the tokens a row generates past its own ``max_tokens``
are wasted work. Batches are formed first-come-first-served.

(a) Same KV-cache memory budget of ``B`` token slots. Static batching reserves contiguous
    max-length space per sequence, so a batch holds at most
    ``B // (padded prompt len + max_new_tokens)`` sequences; ours gets
    ``num_kv_blocks = B / block_size + 1`` (block 0 is reserved) and admits by blocks actually
    used, with no cap on concurrent sequences.
(b) Same batch size: at most ``--batch-size`` concurrent sequences for both; ours with
    ``max_num_seqs`` = that and a KV cache large enough to never bind.

A third system, "static on our engine", runs the SAME static batches through our engine in
waves (each request generating to its batch's maximum, only requested tokens counted). It has
our runtime's per-token costs and static batching's schedule, so ours / it isolates what
continuous batching + paging buys from how fast each implementation runs a forward.

For our engine it also reports host overhead per step (``Engine.last_step_host_s``),
block-manager round trips per step, preemptions and KV waste (allocated slots not holding a
token); ``--grpc`` adds runs of (a) with the block manager as a separate process on loopback,
synchronous and with ``--async-scheduling``.
Correctness is checked in the same run: our greedy tokens must equal HF's (mismatch count 0).

torch runs single-threaded (``torch.set_num_threads(1)``): on a small, shared CPU box more
threads make tiny-model forwards far slower, and one thread makes runs comparable.

Usage: ``python -m bench.engine_bench [--num-requests 128] [--repeats 2] [--grpc]`` (about 3
minutes on 2 CPU cores with ``--grpc``); ``--only a/ours,b/ours`` runs a subset (for a profile:
``python -m cProfile -s cumtime -m bench.engine_bench --only b/ours --repeats 1``),
``--watermark`` and ``--max-num-batched-tokens`` set our scheduler's knobs, ``--help`` lists
the sizes. Exit status 1 if any greedy output differs. Not a test: prints markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from bench.common.engines import EngineSystem, greedy
from bench.common.hf import hf_generate
from bench.common.models import write_bench_model
from bench.common.stats import median as med
from bench.common.stats import percentile as pct
from bench.common.stats import spread
from bench.common.workloads import BOS_ID, Req, make_requests, requested_tokens
from pagedserve.testing.procs import ServiceProcess
from services.common.logging import configure_logging
from services.executor.api import ExecutorConfig

__all__ = ["EngineSystem", "RunResult", "mismatches", "model_sizes", "our_system", "run_ours"]


def model_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The model sizes the command line asks for, as ``write_bench_model`` takes them."""
    return {
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
    }


# ---- static batching ------------------------------------------------------------------------


def reservation(batch: Sequence[Req]) -> int:
    """Contiguous max-length slots per sequence: padded prompt + max_new_tokens."""
    return max(len(r.prompt) for r in batch) + max(r.max_tokens for r in batch)


def static_batches(
    reqs: Sequence[Req], *, budget_tokens: int | None, batch_size: int | None
) -> list[list[Req]]:
    """First-come-first-served batches: a request joins the current batch while
    ``len(batch) * reservation(batch) <= budget_tokens`` and ``len(batch) <= batch_size``."""
    batches: list[list[Req]] = []
    cur: list[Req] = []
    for r in reqs:
        cand = [*cur, r]
        too_big = (budget_tokens is not None and len(cand) * reservation(cand) > budget_tokens) or (
            batch_size is not None and len(cand) > batch_size
        )
        if too_big and cur:
            batches.append(cur)
            cand = [r]
        if budget_tokens is not None and reservation(cand) > budget_tokens:
            raise ValueError(f"{r.req_id} alone needs {reservation(cand)} slots > budget")
        cur = cand
    if cur:
        batches.append(cur)
    return batches


@dataclass
class WasteStats:
    """KV slots allocated (ours) or reserved (static) that hold no requested token, sampled
    after every step."""

    peak_slots: int = 0
    peak_allocated: int = 0  # allocated slots at the step of peak waste
    peak_seqs: int = 0  # sequences holding blocks at that step
    max_per_seq: int = 0  # largest waste of one sequence (ours: < block_size by design)
    waste_sum: int = 0
    allocated_sum: int = 0

    def add(self, waste: int, allocated: int, num_seqs: int, max_per_seq: int = 0) -> None:
        if waste > self.peak_slots:
            self.peak_slots, self.peak_allocated, self.peak_seqs = waste, allocated, num_seqs
        self.max_per_seq = max(self.max_per_seq, max_per_seq)
        self.waste_sum += waste
        self.allocated_sum += allocated

    @property
    def peak_share(self) -> float:
        return self.peak_slots / max(1, self.peak_allocated)

    @property
    def mean_share(self) -> float:
        """Slot-weighted over steps: sum of waste / sum of allocated."""
        return self.waste_sum / max(1, self.allocated_sum)


def static_waste(batches: Sequence[Sequence[Req]]) -> WasteStats:
    """Per decode step t (1..N) of each batch: reserved B*(P+N) slots, of which
    sum(p_i + min(t, n_i)) hold a requested token; padding, not-yet-generated slots and tokens
    past a row's own max_tokens are waste."""
    w = WasteStats()
    for batch in batches:
        reserved = len(batch) * reservation(batch)
        prompt = sum(len(r.prompt) for r in batch)
        for t in range(1, max(r.max_tokens for r in batch) + 1):
            useful = prompt + sum(min(t, r.max_tokens) for r in batch)
            w.add(reserved - useful, reserved, len(batch))
    return w


@dataclass
class RunResult:
    wall_s: float
    cpu_s: float  # process CPU time: cpu/wall well below 1 means other jobs took our core
    outputs: dict[str, list[int]]
    num_steps: int = 0
    max_concurrency: int = 0
    mean_concurrency: float = 0.0
    # ours only
    host_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # wall of Engine.step() seen by the caller
    round_trips: int = 0
    steps_ahead: int = 0  # steps whose Step was sent during the forward before (async)
    computed_tokens: int = 0  # tokens run through the model (recomputation included)
    preemptions: int = 0
    waste: WasteStats | None = None


def hf_batch(model: PreTrainedModel, batch: Sequence[Req], pad_id: int) -> list[list[int]]:
    """One static batch through HF ``generate()``: each row's requested tokens."""
    return hf_generate(model, [r.prompt for r in batch], [r.max_tokens for r in batch], pad_id)


def run_hf_static(model: PreTrainedModel, batches: list[list[Req]], pad_id: int) -> RunResult:
    outputs: dict[str, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in batches:
        for r, toks in zip(batch, hf_batch(model, batch, pad_id), strict=True):
            outputs[r.req_id] = toks
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = sum(max(r.max_tokens for r in b) for b in batches)
    conc = sum(len(b) * max(r.max_tokens for r in b) for b in batches) / steps
    return RunResult(wall, cpu, outputs, steps, max(len(b) for b in batches), conc)


# ---- our engine -----------------------------------------------------------------------------


def our_system(
    model_dir: str,
    max_model_len: int,
    num_kv_blocks: int,
    max_num_seqs: int,
    blockmgr_address: str | None = None,
    dtype: str = "float32",
    **config: Any,
) -> EngineSystem:
    """Our engine on the CPU: the model loaded once, a fresh engine per run."""
    return EngineSystem(
        ExecutorConfig(
            model=model_dir,
            dtype=dtype,
            device="cpu",
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            **config,
        ),
        blockmgr_address,
    )


def run_ours(system: EngineSystem, waves: list[list[Req]], *, pad_to_batch_max: bool) -> RunResult:
    """Run ``waves`` one after the other (one wave = continuous batching of everything;
    several waves with ``pad_to_batch_max`` = static batching on our engine)."""
    outputs: dict[str, list[int]] = {r.req_id: [] for w in waves for r in w}
    asked = {r.req_id: r.max_tokens for w in waves for r in w}
    res = RunResult(0.0, 0.0, outputs, waste=WasteStats())
    assert res.waste is not None
    tok0 = system.timer.num_tokens
    conc_sum = 0
    instr_s = 0.0  # bookkeeping time, taken off the wall clock
    with system.engine() as engine:
        t0, c0 = time.perf_counter(), time.process_time()
        for wave in waves:
            n_wave = max(r.max_tokens for r in wave)
            for r in wave:
                engine.submit(
                    r.prompt,
                    greedy(n_wave if pad_to_batch_max else r.max_tokens),
                    request_id=r.req_id,
                )
            while engine.has_work:
                ts = time.perf_counter()
                outs = engine.step()
                te = time.perf_counter()
                for o in outs:
                    outputs[o.request_id].extend(o.token_ids)
                res.step_s.append(te - ts)
                stats = engine.stats()
                res.host_s.append(stats.last_step_host_s)
                res.forward_s.append(stats.last_step_forward_s)
                # Slots granted ahead (async scheduling) are for tokens of the next forward.
                kv = engine.kv_usage()
                conc_sum += kv.num_seqs
                res.max_concurrency = max(res.max_concurrency, kv.num_seqs)
                res.waste.add(
                    kv.num_unused_slots, kv.num_slots, kv.num_seqs, kv.max_seq_unused_slots
                )
                instr_s += time.perf_counter() - te
        res.wall_s = time.perf_counter() - t0 - instr_s
        res.cpu_s = time.process_time() - c0 - instr_s
        final = engine.stats()
    for rid, toks in outputs.items():
        assert len(toks) >= asked[rid], f"{rid}: {len(toks)} tokens < {asked[rid]}"
        del toks[asked[rid] :]
    res.num_steps = len(res.step_s)
    res.mean_concurrency = conc_sum / max(1, res.num_steps)
    res.round_trips = final.num_round_trips
    res.steps_ahead = final.num_steps_ahead
    res.preemptions = final.num_preemptions
    res.computed_tokens = system.timer.num_tokens - tok0
    return res


# ---- gRPC block manager ---------------------------------------------------------------------


@contextlib.contextmanager
def blockmgr_process() -> Iterator[str]:
    """``pagedserve blockmgr`` on a free loopback port; yields its address."""
    proc = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    try:
        yield proc.address
    finally:
        proc.stop()


# ---- reporting ------------------------------------------------------------------------------


def mismatches(got: dict[str, list[int]], ref: dict[str, list[int]], ids: Sequence[str]) -> int:
    return sum(got[i] != ref[i] for i in ids)


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = ap.add_argument
    g = ap.add_argument_group("model (a tiny random Llama written for the run)")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=8)
    g.add_argument("--num-kv-heads", type=int, default=4)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--model-seed", type=int, default=0)
    r = ap.add_argument_group("requests")
    r.add_argument("--num-requests", type=int, default=128)
    r.add_argument("--min-prompt", type=int, default=8, help="prompt tokens, BOS included")
    r.add_argument("--max-prompt", type=int, default=128)
    r.add_argument("--min-output", type=int, default=8)
    r.add_argument("--max-output", type=int, default=256)
    r.add_argument("--seed", type=int, default=0)
    a("--block-size", type=int, default=16)
    a(
        "--budget-seqs",
        type=float,
        default=16.0,
        help="(a): KV budget in max-length sequences (max_prompt + max_output slots each)",
    )
    a("--batch-size", type=int, default=16, help="(b): max concurrent sequences, both systems")
    a(
        "--watermark",
        type=float,
        default=ExecutorConfig.watermark,
        help="ours: share of KV blocks admissions keep free",
    )
    a(
        "--max-num-batched-tokens",
        type=int,
        default=ExecutorConfig.max_num_batched_tokens,
        help="ours: token budget of one step (chunked prefill)",
    )
    a("--repeats", type=int, default=2, help="timed runs of each system (interleaved)")
    a(
        "--check",
        type=int,
        default=16,
        help="requests also checked against HF generate() on their own, unpadded",
    )
    a("--grpc", action="store_true", help="also run (a) with the block manager over gRPC")
    a("--no-static-ours", action="store_true", help="skip static batching on our engine")
    a("--only", default="", help="comma-separated systems to run, e.g. a/ours,b/ours")
    return ap.parse_args(argv)


SYSTEM_LABELS = {
    "ours": "ours (continuous + paged)",
    "ours-grpc": "ours, block manager over gRPC",
    "ours-grpc-async": "ours, gRPC block manager, --async-scheduling",
    "static-hf": "static: HF generate()",
    "static-ours": "static batches on our engine",
}
ALL_SYSTEMS = (
    "a/ours",
    "a/static-hf",
    "a/static-ours",
    "b/ours",
    "b/static-hf",
    "b/static-ours",
    "a/ours-grpc",
    "a/ours-grpc-async",
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    configure_logging("engine_bench", "ERROR")  # preemption warnings would flood the table
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    wanted = [n for n in ALL_SYSTEMS if "grpc" not in n or args.grpc]
    if args.no_static_ours:
        wanted = [n for n in wanted if "static-ours" not in n]
    if args.only:
        only = args.only.split(",")
        bad = sorted(set(only) - set(ALL_SYSTEMS))
        if bad:
            sys.exit(f"--only: unknown {bad}; choose from {list(ALL_SYSTEMS)}")
        wanted = [n for n in ALL_SYSTEMS if n in only]
    bs = args.block_size
    max_len = args.max_prompt + args.max_output
    budget = int(args.budget_seqs * max_len) // bs * bs

    with tempfile.TemporaryDirectory(prefix="engine_bench_") as tmp:
        model_dir = str(
            write_bench_model(
                Path(tmp) / "model", seed=args.model_seed, max_len=max_len, **model_sizes(args)
            )
        )
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # ignore_eos on our side makes EOS an ordinary token; HF must neither stop at it nor
        # ban it (min_new_tokens does, when the config has an EOS id), or greedy tokens differ.
        eos_id = int(hf.generation_config.eos_token_id)
        hf.generation_config.eos_token_id = None
        pad_id = int(hf.config.pad_token_id)
        vocab = hf.config.vocab_size
        n_params = sum(p.numel() for p in hf.parameters())
        reqs = make_requests(
            args.num_requests,
            (args.min_prompt, args.max_prompt),
            (args.min_output, args.max_output),
            vocab,
            args.seed,
        )
        total = requested_tokens(reqs)
        # Tokens a forward must see: every prompt token and every output token but the last.
        needed = sum(len(r.prompt) for r in reqs) + total - len(reqs)

        batches = {
            "a": static_batches(reqs, budget_tokens=budget, batch_size=None),
            "b": static_batches(reqs, budget_tokens=None, batch_size=args.batch_size),
        }
        kv_blocks = {"a": budget // bs + 1, "b": (args.batch_size + 1) * -(-max_len // bs) + 1}
        max_seqs = {"a": 1024, "b": args.batch_size}
        knobs = {
            "watermark": args.watermark,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "cpu_threads": 1,  # as torch.set_num_threads(1) above: the runner sets its own
        }
        ours = {
            k: our_system(model_dir, max_len, kv_blocks[k], max_seqs[k], None, **knobs)
            for k in "ab"
        }

        # Warm-up (first-call costs of torch / transformers), untimed.
        warm = [Req(f"w{i}", [BOS_ID, 5 + i, 7, 9], 4) for i in range(2)]
        hf_batch(hf, warm, pad_id)
        run_ours(ours["a"], [warm], pad_to_batch_max=False)

        def system(name: str) -> Callable[[], RunResult]:
            scen, kind = name.split("/")
            if kind == "ours":
                return lambda: run_ours(ours[scen], [reqs], pad_to_batch_max=False)
            if kind == "static-ours":
                return lambda: run_ours(ours[scen], batches[scen], pad_to_batch_max=True)
            if kind == "static-hf":
                return lambda: run_hf_static(hf, batches[scen], pad_id)
            key = kind.removeprefix("ours-")
            return lambda: run_ours(ours[key], [reqs], pad_to_batch_max=False)

        results: dict[str, list[RunResult]] = {n: [] for n in wanted}
        uses_grpc = any("grpc" in n for n in wanted)
        grpc_ctx = blockmgr_process() if uses_grpc else contextlib.nullcontext()
        t_all = time.perf_counter()
        with grpc_ctx as address:
            if address:
                for key, extra in (("grpc", {}), ("grpc-async", {"async_scheduling": True})):
                    ours[key] = our_system(
                        model_dir, max_len, kv_blocks["a"], 1024, address, **knobs, **extra
                    )
                    run_ours(ours[key], [warm], pad_to_batch_max=False)
            for rep in range(args.repeats):
                for name in wanted:
                    res = system(name)()
                    results[name].append(res)
                    print(
                        f"[repeat {rep + 1}/{args.repeats}] {name:14s} {res.wall_s:7.2f} s  "
                        f"cpu/wall {res.cpu_s / res.wall_s:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )

        # Correctness. HF's padded static batches cover every request; HF generate() on one
        # unpadded prompt (the plainest reference) covers a sample.
        ids = [r.req_id for r in reqs]
        ref_name = next((n for n in ("a/static-hf", "b/static-hf") if n in results), None)
        checks: dict[str, int] = {}
        if ref_name:
            ref = results[ref_name][0].outputs
            for name in results:
                if name != ref_name:
                    checks[f"{name} vs {ref_name}, all {len(ids)} requests"] = mismatches(
                        results[name][0].outputs, ref, ids
                    )
        sample = random.Random(args.seed + 1).sample(reqs, min(args.check, len(reqs)))
        alone = {r.req_id: hf_batch(hf, [r], pad_id)[0] for r in sample}
        for name in results:
            checks[f"{name} vs HF generate() alone (unpadded), sample of {len(alone)}"] = (
                mismatches(results[name][0].outputs, alone, list(alone))
            )
        some = results[wanted[0]][0].outputs
        num_eos = sum(t == eos_id for toks in some.values() for t in toks)
        bench_s = time.perf_counter() - t_all

    report(
        args,
        results,
        checks,
        reqs,
        batches,
        ours,
        budget,
        vocab,
        n_params,
        num_eos,
        needed,
        bench_s,
    )
    if any(checks.values()):
        sys.exit(1)


def report(
    args: argparse.Namespace,
    results: dict[str, list[RunResult]],
    checks: dict[str, int],
    reqs: list[Req],
    batches: dict[str, list[list[Req]]],
    ours: dict[str, EngineSystem],
    budget: int,
    vocab: int,
    n_params: int,
    num_eos: int,
    needed: int,
    bench_s: float,
) -> None:
    out = print
    bs = args.block_size
    total = requested_tokens(reqs)
    max_len = args.max_prompt + args.max_output
    out("\n## Engine benchmark: continuous batching + paged KV vs static batching\n")
    out(
        f"- machine: {os.cpu_count()} CPUs, torch {torch.__version__}, CPU, fp32, "
        f"**torch.set_num_threads(1)** (on this small shared box more threads make a tiny "
        f"model's forward far slower); transformers {transformers.__version__}"
    )
    out(
        f"- model: tiny random Llama, hidden {args.hidden_size}, {args.num_layers} layers, "
        f"{args.num_heads} heads / {args.num_kv_heads} KV heads (head dim "
        f"{args.hidden_size // args.num_heads}), MLP {args.intermediate_size}, vocab {vocab}: "
        f"{n_params / 1e6:.2f} M parameters"
    )
    p_lens = [len(r.prompt) for r in reqs]
    o_lens = [r.max_tokens for r in reqs]
    out(
        f"- requests: {len(reqs)} (seed {args.seed}), all arriving at t=0, greedy, ignore_eos; "
        f"prompt {min(p_lens)}-{max(p_lens)} tokens (mean {statistics.mean(p_lens):.0f}, "
        f"{sum(p_lens)} in all); max_tokens {min(o_lens)}-{max(o_lens)} (mean "
        f"{statistics.mean(o_lens):.0f}): **{total} requested output tokens**, of which "
        f"{num_eos} are the EOS id (generated and ignored: neither stop nor ban it)"
    )
    ba, bb = batches["a"], batches["b"]
    out(
        f"- (a) same KV budget: {budget} token slots = {args.budget_seqs:g} x {max_len} "
        f"(max prompt + max output). Ours: num_kv_blocks {budget // bs + 1} x {bs} slots, no "
        f"max_num_seqs cap (watermark {args.watermark:g}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}). Static: {len(ba)} FCFS batches of {min(map(len, ba))}-"
        f"{max(map(len, ba))} (batch = budget // (padded prompt + max_new_tokens))"
    )
    out(
        f"- (b) same batch size {args.batch_size}: ours max_num_seqs {args.batch_size}, "
        f"{ours['b'].num_kv_blocks} KV blocks (never binding). Static: {len(bb)} batches "
        f"of <= {args.batch_size}"
    )
    out(
        f"- {args.repeats} timed repeat(s) per system, interleaved; cells are median "
        f"(min-max). Wall clock excludes model load and warm-up, and the benchmark's own "
        f"per-step bookkeeping. cpu/wall well under 1 means another job took the core.\n"
    )

    tps = {k: [total / r.wall_s for r in v] for k, v in results.items()}
    out(
        "| scenario | system | concurrency max / mean | steps | ms / step | wall s | "
        "output tok/s | ours / this | cpu/wall |"
    )
    out("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        scen, kind = name.split("/")
        ours_tps = tps.get(f"{scen}/ours")
        ratio = "-"
        if ours_tps and not kind.startswith("ours"):
            ratio = spread([o / s for o, s in zip(ours_tps, tps[name], strict=True)], "{:.2f}x")
        r0 = runs[0]
        ms_step = [r.wall_s / r.num_steps * 1e3 for r in runs]
        out(
            f"| ({scen}) | {SYSTEM_LABELS[kind]} | {r0.max_concurrency} / "
            f"{r0.mean_concurrency:.1f} | {r0.num_steps} | {spread(ms_step, '{:.2f}')} | "
            f"{spread([r.wall_s for r in runs], '{:.2f}')} | "
            f"{spread(tps[name], '{:.0f}')} | {ratio} | "
            f"{spread([r.cpu_s / r.wall_s for r in runs], '{:.2f}')} |"
        )
    out(
        "\nSteps of static rows are decode steps: each batch runs to its longest member. "
        '"ours / this" is taken per repeat (same repeat index), then the median. '
        '"static batches on our engine" runs the static batches through our engine in '
        "waves, each request generating to its batch's max: static scheduling at our "
        "runtime's per-token cost.\n"
    )

    out("### Our engine: host overhead, block manager, preemption, KV waste\n")
    out(
        "| run | host ms / step: mean / p50 / p99 | forward ms: mean / p50 | host share | "
        "Step RPCs / step | Steps sent ahead | preemptions | model tokens / needed | "
        "peak KV waste: slots, share of allocated (seqs) | mean waste share | "
        "max waste of one seq |"
    )
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        if "static-hf" in name:
            continue
        host = [h for r in runs for h in r.host_s]
        fwd = [f for r in runs for f in r.forward_s]
        r0 = runs[0]
        w = r0.waste
        assert w is not None
        out(
            f"| {name} | {statistics.mean(host) * 1e3:.2f} / {med(host) * 1e3:.2f} / "
            f"{pct(host, 0.99) * 1e3:.2f} | {statistics.mean(fwd) * 1e3:.2f} / "
            f"{med(fwd) * 1e3:.2f} | {sum(host) / (sum(host) + sum(fwd)):.1%} | "
            f"{r0.round_trips / r0.num_steps:.3f} | {r0.steps_ahead / r0.num_steps:.0%} | "
            f"{r0.preemptions} | "
            f"{r0.computed_tokens / needed:.3f} | {w.peak_slots}, {w.peak_share:.1%} "
            f"({w.peak_seqs}) | {w.mean_share:.1%} | {w.max_per_seq} |"
        )
    for scen in "ab":
        w = static_waste(batches[scen])
        out(
            f"| ({scen}) static, max-length reservation | - | - | - | - | - | - | - | "
            f"{w.peak_slots}, {w.peak_share:.1%} of reserved ({w.peak_seqs}) | "
            f"{w.mean_share:.1%} | {w.max_per_seq or '-'} |"
        )
    out(
        "\nhost = `Engine.last_step_host_s` (plan, block-manager Step, sampling, "
        "bookkeeping); forward = `last_step_forward_s` (batch building + model); host share = "
        "sum(host) / sum(host + forward). Model tokens / needed: tokens run through the model "
        "over prompt tokens + output tokens but the last (> 1: recomputation after preemption "
        "or, for static, tokens past max_tokens). KV waste = sum over running sequences of "
        "len(block_table) * block_size - num_computed_tokens (- slots granted ahead for the "
        "next forward), after every step; for static, "
        "B * (padded prompt + max_new_tokens) reserved minus slots holding a prompt or "
        "requested token, at every decode step. Mean waste share = sum(waste) / "
        "sum(allocated) over steps.\n"
    )

    out("### Correctness (greedy token ids)\n")
    for k, v in checks.items():
        out(f"- {k}: **{v} mismatches**")
    out(f"\n(timed runs + checks: {bench_s:.0f} s)")


if __name__ == "__main__":
    main()
