"""GPU engine benchmark: decode speed with CUDA graphs against ``--enforce-eager`` and HF.

    python -m bench.internals.gpu_engine [--preset llama-1b] [--num-requests 256] [--skip-hf]
        [--kv-cache-dtype fp8|int8|...] [--parity-requests N]
    python -m bench.internals.gpu_engine --cpu-dry-run    # every code path, tiny, on the CPU

Writes a random-weight Llama (``llama-1b``: hidden 2048, 16 layers, 32 query / 8 KV heads,
head_dim 64, intermediate 8192, vocab 32000, about 1.1 B parameters) in bf16, then runs the
workload of issue 9 through the engine in-process with default flags: every request arrives
at once, prompts uniform in [32, 512] tokens, outputs uniform in [16, 256], seeded, greedy,
``ignore_eos``. A warm-up run first (Triton's JIT compiling every kernel variant; its
tok/s printed apart, and 20 of its full-batch decode steps under cProfile: the host's top
functions by own time), then once with CUDA graphs, once with graphs and async scheduling, once
eager; then HF ``generate()`` on padded static batches of 64 and 256.

Reported per run: output tok/s over the wall clock; the median decode step at batch >= 200
(wall, host, forward); the GPU-busy share and the kernel launches of one full-batch decode
step (torch profiler: summed kernel time over the step's wall time); the roofline floor of
that step (weights + the batch's KV read once at the measured device copy rate); and how many
requests' greedy tokens agree between the graphed and the eager run (bf16 attention splits
differ between the two, so a late divergence is possible and is reported, not hidden); and
the graphed run's tokens of the first ``--parity-requests`` requests scored by HF's model in
the same dtype, teacher-forced: identical, leaving HF's argmax at a near-tie (``--tie-tolerance``
of the largest |logit|), or leaving it elsewhere (a real mismatch).
Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common.hf import hf_agreement, hf_argmax, hf_generate
from bench.common.timers import ForwardTimer
from bench.common.workloads import Req, make_requests
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.api.hooks import HookedRunner
from services.executor.core.engine import Engine
from services.executor.core.outputs import SeqOutput
from services.executor.core.sequence import RequestKey
from services.executor.model.cuda_graphs import EagerGraphBackend
from services.executor.model.launch import build_runner
from services.executor.model.runner import ModelRunner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

PRESETS: dict[str, dict[str, int]] = {
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
}
FULL_BATCH = 200


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    output_tokens: int = 0
    decode_steps: list[tuple[float, float, float]] = field(default_factory=list)  # wall, host, fwd
    busy_share: float | None = None
    launches: int | None = None
    floor_ms: float | None = None
    tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def write_model(preset: str, device: str, dtype: torch.dtype, out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **PRESETS[preset],
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(str(out))
    del model
    return out


def decode_batch(timer: ForwardTimer) -> int:
    """The sequences of the last forward if it was a pure decode, else 0."""
    last = timer.last
    return last.info.num_seqs if last is not None and last.info.is_decode else 0


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    if device.type != "cuda":
        return 10e9
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * x.numel() * 4 / (start.elapsed_time(end) / 1e3)


def profile_step(engine: Engine, device: torch.device) -> tuple[float, int, list[SeqOutput]]:
    """(GPU-busy share, kernel launches, outputs) of one engine step, by the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        outputs = engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    if device.type == "cuda":
        busy_us = sum(e.device_time for e in events if e.device_type.name == "CUDA")
        launches = sum(
            1
            for e in events
            if e.name
            in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx")
        )
    else:
        busy_us, launches = sum(e.self_cpu_time_total for e in events), 0
    return min(busy_us / 1e6 / wall, 1.0), launches, outputs


def run_engine(
    name: str,
    model_dir: Path,
    reqs: list[Req],
    args: argparse.Namespace,
    eager: bool,
    async_scheduling: bool = False,
    host_profile_steps: int = 0,
) -> Run:
    """One engine run over ``reqs``. ``host_profile_steps``: that many full-batch decode
    steps (after ``--host-profile-after`` others, past the JIT's compiles) run under
    cProfile, whose top functions by own time are printed: where the host's time goes."""
    device = torch.device(args.device)
    config = ExecutorConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        enforce_eager=eager,
        async_scheduling=async_scheduling,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=None if device.type == "cuda" else 64 << 20,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    inner = build_runner(config.runner_config())
    if device.type != "cuda" and not eager:  # the dry run exercises the graph path too
        inner.capture_decode_graphs(config.capture_sizes, EagerGraphBackend())
    timer = ForwardTimer()  # what each forward computed (its time means little on CUDA)
    runner = HookedRunner(inner, timer)
    engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())  # type: ignore[arg-type]
    run = Run(name)
    for r in reqs:
        engine.add_request(
            RequestKey(0, r.req_id),
            r.prompt,
            SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
        )
    full = args.full_batch
    profiled = False
    host_profile, full_steps, host_profiled = cProfile.Profile(), 0, 0
    t0 = time.perf_counter()
    while engine.has_work:
        s0 = time.perf_counter()
        full_steps += decode_batch(timer) >= full
        if (
            decode_batch(timer) >= full
            and full_steps > args.host_profile_after
            and host_profiled < host_profile_steps
        ):
            host_profiled += 1
            host_profile.enable()
            for o in engine.step():
                run.tokens.setdefault(o.req_id.request_id, []).extend(o.token_ids)
            host_profile.disable()
            continue
        if not profiled and decode_batch(timer) >= full and args.profile:
            run.busy_share, run.launches, outputs = profile_step(engine, device)
            last = timer.last
            assert last is not None
            bandwidth = copy_bandwidth(device)
            run.floor_ms = floor_ms(inner, last.info.num_context_tokens, bandwidth)
            profiled = True
        else:
            outputs = engine.step()
            if decode_batch(timer) >= full:
                wall = time.perf_counter() - s0
                run.decode_steps.append((wall, engine.last_step_host_s, engine.last_step_forward_s))
        for o in outputs:
            run.tokens.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    run.wall_s = time.perf_counter() - t0
    if host_profiled:
        print(f"\nhost profile of {host_profiled} full-batch decode steps ({name}), by own time:")
        pstats.Stats(host_profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    run.output_tokens = sum(len(t) for t in run.tokens.values())
    del engine, runner, inner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def floor_ms(runner: ModelRunner, context_tokens: int, bandwidth: float) -> float:
    """Weights once plus every sequence's K/V (``context_tokens``) once, at the device copy
    rate (read share)."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    mc = runner.config
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * runner.kv_cache.element_size()
    kv = context_tokens * per_token
    return (weights + kv) / (bandwidth / 2) * 1e3


def run_hf(model_dir: Path, reqs: list[Req], batch: int, args: argparse.Namespace) -> Run:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device)
    model.eval()
    run = Run(f"HF static, batch {batch}")
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch):
        part = reqs[start : start + batch]
        prompts, lengths = [r.prompt for r in part], [r.max_tokens for r in part]
        hf_generate(model, prompts, lengths, pad_id=0, exact=False)
        run.output_tokens += sum(lengths)
    if args.device == "cuda":
        torch.cuda.synchronize()
    run.wall_s = time.perf_counter() - t0
    del model
    return run


def hf_parity(model_dir: Path, reqs: list[Req], run: Run, args: argparse.Namespace) -> str:
    """The first ``--parity-requests`` requests' greedy tokens of ``run`` scored by HF's model
    in the same dtype, teacher-forced: identical, left at a near-tie, or left where HF was
    sure (a real mismatch). Below fp32, also the rounding's own noise: at every position,
    how often HF's fp32 argmax is picked by ours and by HF in the same dtype."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    scored = [r for r in reqs[: args.parity_requests] if run.tokens[r.req_id]]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device)
    model.eval()
    same = ties = 0
    wrong: list[tuple[Req, int, float]] = []
    picks: dict[int, torch.Tensor] = {}  # HF's own argmax in this dtype, per request
    for r in scored:
        tokens = run.tokens[r.req_id]
        got = hf_agreement(model, r.prompt, tokens, args.tie_tolerance)
        if got.first is None:
            same += 1
        elif got.tie:
            ties += 1
        else:
            wrong.append((r, got.first, got.margin))
        if dtype != torch.float32:
            picks[r.req_id] = hf_argmax(model, r.prompt, tokens)
    del model
    line = (
        f"HF parity ({args.dtype}, {run.name}, {len(scored)} requests, teacher-forced): "
        f"{same} identical, {ties} leave HF's argmax at a near-tie (gap <= {args.tie_tolerance} "
        f"of max |logit|), {len(wrong)} elsewhere"
    )
    line += (
        f": {', '.join(f'{r.req_id}@{i} (gap {m:.3f})' for r, i, m in wrong[:8])}" if wrong else ""
    )
    if not picks:
        return line
    # The reference without rounding noise: HF in fp32, on the same (our) prefixes.
    exact = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    exact = exact.to(args.device).eval()
    positions = ours_hits = hf_hits = 0
    wrong_but_exact = 0
    for r in scored:
        tokens = torch.tensor(run.tokens[r.req_id])
        best = hf_argmax(exact, r.prompt, run.tokens[r.req_id])
        positions += len(tokens)
        ours_hits += int((tokens == best).sum())
        hf_hits += int((picks[r.req_id] == best).sum())
        wrong_but_exact += sum(1 for w, i, _ in wrong if w is r and int(best[i]) == int(tokens[i]))
    del exact
    return line + (
        f"\nagainst HF in float32 at all {positions} teacher-forced positions (the "
        f"{args.dtype} rounding's own noise): ours picks its argmax at "
        f"{ours_hits / positions:.1%}, HF in {args.dtype} at {hf_hits / positions:.1%}; at "
        f"{wrong_but_exact} of the {len(wrong)} divergences elsewhere, ours is HF float32's argmax"
    )


def report(
    runs: list[Run], graphed: Run | None, eager: Run | None, overlapped: Run | None = None
) -> None:
    print(
        "| run | output tok/s | full-batch decode step: wall / host / forward ms "
        "| GPU busy | kernel launches / step | roofline floor ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        if r.decode_steps:
            wall, host, fwd = (
                statistics.median(x[i] for x in r.decode_steps) * 1e3 for i in range(3)
            )
            step = f"{wall:.2f} / {host:.2f} / {fwd:.2f}"
        else:
            step = "-"
        busy = f"{r.busy_share:.0%}" if r.busy_share is not None else "-"
        launches = str(r.launches) if r.launches is not None else "-"
        floor = f"{r.floor_ms:.2f}" if r.floor_ms is not None else "-"
        print(f"| {r.name} | {r.tok_s:,.0f} | {step} | {busy} | {launches} | {floor} |")
    if graphed and eager:
        same = sum(graphed.tokens[k] == eager.tokens.get(k) for k in graphed.tokens)
        print(f"\ngraphed vs eager greedy tokens: {same}/{len(graphed.tokens)} requests identical")
        if graphed.tok_s and eager.tok_s:
            print(f"CUDA graphs speed-up (output tok/s): {graphed.tok_s / eager.tok_s:.2f}x")
    if graphed and overlapped:
        same = sum(graphed.tokens[k] == overlapped.tokens.get(k) for k in graphed.tokens)
        print(
            f"async scheduling vs not, greedy tokens: {same}/{len(graphed.tokens)} requests "
            f"identical; speed-up (output tok/s): {overlapped.tok_s / graphed.tok_s:.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="llama-1b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-range", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--full-batch",
        type=int,
        default=FULL_BATCH,
        help="decode steps of at least this many sequences are timed and profiled",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--parity-requests", type=int, default=32, help="scored by HF (0: none)")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the executor's (fp8, int8, ...): every run of ours stores its KV cache so",
    )
    ap.add_argument(
        "--tie-tolerance",
        type=float,
        default=0.01,
        help="a divergence where HF's logit gap is at most this share of its max |logit| is "
        "a near-tie",
    )
    ap.add_argument("--host-profile-after", type=int, default=30, help="full-batch steps")
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny preset, 12 short requests, fp32, on the CPU: proves the script",
    )
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        args.preset, args.device, args.dtype = "tiny", "cpu", "float32"
        args.num_requests, args.prompt_range, args.output_range = 12, (4, 40), (4, 24)
        args.max_model_len, args.max_num_seqs, args.hf_batches = 128, 8, [4]
        args.full_batch, args.host_profile_after = 6, 2
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("no CUDA: nothing to run (use --cpu-dry-run to check the script)")
        return 0
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = write_model(args.preset, args.device, dtype, Path(tmp) / args.preset)
        print(f"model {args.preset} written in {time.perf_counter() - t0:.1f} s", flush=True)
        vocab = PRESETS[args.preset]["vocab_size"]
        reqs = make_requests(
            args.num_requests, tuple(args.prompt_range), tuple(args.output_range), vocab, seed=0
        )
        # Triton compiles each kernel variant on first use, seconds each: the first run
        # pays that (reported apart), the timed runs do not.
        cold = run_engine("warm-up", model_dir, reqs, args, eager=False, host_profile_steps=20)
        print(f"warm-up run (CUDA graphs, JIT compiling): {cold.tok_s:,.0f} tok/s", flush=True)
        graphed = run_engine("ours, CUDA graphs", model_dir, reqs, args, eager=False)
        print(f"graphed run: {graphed.tok_s:,.0f} tok/s", flush=True)
        eager = run_engine("ours, --enforce-eager", model_dir, reqs, args, eager=True)
        print(f"eager run: {eager.tok_s:,.0f} tok/s", flush=True)
        overlapped = run_engine(
            "ours, CUDA graphs, --async-scheduling",
            model_dir,
            reqs,
            args,
            eager=False,
            async_scheduling=True,
        )
        print(f"async-scheduling run: {overlapped.tok_s:,.0f} tok/s", flush=True)
        runs = [graphed, overlapped, eager]
        parity = hf_parity(model_dir, reqs, graphed, args) if args.parity_requests else ""
        if not args.skip_hf:
            for b in args.hf_batches:
                runs.append(run_hf(model_dir, reqs, b, args))
                print(f"{runs[-1].name}: {runs[-1].tok_s:,.0f} tok/s", flush=True)
    print()
    report(runs, graphed, eager, overlapped)
    if parity:
        print(parity)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
