"""CPU benchmark: our engine against Hugging Face transformers on the same work, in one run.

A random Llama (hidden 512, 4 layers, 8 query / 2 KV heads, MLP 1024, the tiny tokenizer's
621-token vocabulary: 9.55 M parameters, fp32), 64 requests arriving at once with prompts of
35-254 tokens, greedy with ``ignore_eos``, two workloads:

- ``fixed``: every request asks for 64 tokens;
- ``variable``: 16-128 tokens each.

``--family`` picks the random checkpoint (same sizes and init scale, written by
``pagedserve.tools.tiny_model``): ``llama`` (default, above); ``qwen3_moe`` (QK-norm, layer 0
a dense MLP of 1024, the others 4 experts of 512 with 2 per token, so the same active MLP
width: 14.3 M parameters); ``gemma3`` (QK-norm, GELU, sandwich norms, one global layer in
two, the others a ``--sliding-window`` of 128 that the prompts cross: 9.56 M parameters).

Systems, each on ``--threads`` torch threads (default: every core this process may use):

- ``ours``: the in-process engine (continuous batching, paged KV cache, the fast CPU
  attention of ``pagedserve/kernels/cpu_attention.py``, fp32 linear layers through oneDNN,
  ``pagedserve/kernels/cpu_linear.py``);
- ``ours-unpacked``: the same with oneDNN reading the plain weights (``PAGEDSERVE_CPU_PREPACK=0``:
  the projections not packed at load, ``services/executor/model/prepack.py``);
- ``ours-torch-linear``: the same with ``torch.nn.functional.linear`` (MKL) for the linear
  layers (``PAGEDSERVE_CPU_LINEAR=torch``), as HF runs them;
- ``ours-reference-attention``: the same as ``ours`` with the reference attention
  (``PAGEDSERVE_CPU_ATTENTION=reference``), the CPU path before the fast one;
- ``hf-static``: ``model.generate()`` on one left-padded batch of all 64 (sdpa attention),
  running to the longest request (tokens past a request's ``max_tokens`` are not counted);
- ``hf-continuous``: transformers' own continuous batching (``model.generate_batch``, paged),
  where the installed transformers has it; ``fixed`` only (it takes one ``max_new_tokens``);
  reported as "n/a (the error)" where it raises for the family.

Output tok/s counts the tokens requested, over the wall clock of the whole set; medians of
``--repeats`` interleaved repeats. In fp32 the greedy tokens of ``ours`` must equal
``hf-static``'s; ``--dtype bfloat16`` runs every system in bf16 and reports the mismatches
(rounding makes near-ties go either way). Then a
decode step at 64 sequences is broken down, for ours and each ablation: attention, linear
layers (matmuls), the rest of the forward, and the engine's host work.

Usage: ``python -m bench.cpu_bench [--family llama] [--workloads fixed,variable]
[--repeats 2] [--threads N]`` (``--num-requests 16`` for a quick smoke run). Not a test:
prints markdown; exit status 1 if, in fp32, a greedy output of ``ours`` differs from
``hf-static``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.common.engines import EngineSystem
from bench.common.models import write_bench_model
from bench.common.workloads import Req, make_requests
from bench.engine_bench import hf_batch, mismatches, model_sizes, our_system, run_ours
from pagedserve.kernels import ops
from pagedserve.kernels.cpu_linear import CPU_LINEAR_ENV
from services.common.logging import configure_logging
from services.executor.api import PREPACK_ENV, PackedLinear, available_cores

WORKLOADS = {"fixed": (64, 64), "variable": (16, 128)}
FAMILIES = ("llama", "qwen3_moe", "gemma3")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--family", choices=FAMILIES, default="llama", help="the random checkpoint's family")
    a("--sliding-window", type=int, default=128, help="gemma3: its sliding layers' window")
    a("--hidden-size", type=int, default=512)
    a("--num-layers", type=int, default=4)
    a("--num-heads", type=int, default=8)
    a("--num-kv-heads", type=int, default=2)
    a("--intermediate-size", type=int, default=1024)
    a("--num-requests", type=int, default=64)
    a("--min-prompt", type=int, default=35)
    a("--max-prompt", type=int, default=254)
    a("--seed", type=int, default=0)
    a("--model-seed", type=int, default=0)
    a("--repeats", type=int, default=2)
    a("--threads", type=int, default=available_cores(), help="torch threads, every system")
    a("--workloads", default="fixed,variable", help=f"comma-separated, of {sorted(WORKLOADS)}")
    a(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights, activations and KV cache of every system",
    )
    a(
        "--quantization",
        choices=["int8", "bf16", "fp16"],
        default=None,
        help="also run ours with the executor's --quantization (a system of its own)",
    )
    a(
        "--kv-cache-dtype",
        choices=["fp8", "fp8_e5m2", "int8"],
        default=None,
        help="also run ours with the executor's --kv-cache-dtype (a system of its own)",
    )
    args = p.parse_args(argv)
    unknown = set(args.workloads.split(",")) - WORKLOADS.keys()
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    return args


def write_model(directory: Path, args: argparse.Namespace, max_len: int) -> str:
    """The random checkpoint of ``args.family``: a Llama, or a Qwen3-MoE / Gemma 3 of the
    same sizes, seed and init scale (``write_tiny_model``'s)."""
    extra = {"sliding_window": args.sliding_window} if args.family == "gemma3" else {}
    sizes = model_sizes(args)
    path = write_bench_model(
        directory, arch=args.family, seed=args.model_seed, max_len=max_len, **sizes, **extra
    )
    return str(path)


def describe_model(args: argparse.Namespace, model: Any) -> str:
    """The family and sizes of the checkpoint, read back from the loaded HF model."""
    c = model.config
    parts = [
        f"hidden {c.hidden_size}",
        f"{c.num_hidden_layers} layers",
        f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads",
        f"MLP {c.intermediate_size}",
    ]
    if args.family == "qwen3_moe":
        parts.append(
            f"{c.num_experts} experts of {c.moe_intermediate_size}, top-{c.num_experts_per_tok}"
            f", dense layers {list(c.mlp_only_layers)}"
        )
    if args.family == "gemma3":
        full = sum(t == "full_attention" for t in c.layer_types)
        parts.append(
            f"sliding window {c.sliding_window} on {c.num_hidden_layers - full} of "
            f"{c.num_hidden_layers} layers"
        )
    parts.append(f"vocab {c.vocab_size}")
    return f"random {args.family} `{type(model).__name__}` ({', '.join(parts)})"


def _requests(args: argparse.Namespace, workload: str, vocab: int) -> list[Req]:
    prompts = (args.min_prompt, args.max_prompt)
    return make_requests(args.num_requests, prompts, WORKLOADS[workload], vocab, args.seed)


@contextmanager
def _env(variable: str, value: str) -> Iterator[None]:
    old = os.environ.get(variable)
    os.environ[variable] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[variable]
        else:
            os.environ[variable] = old


# The ablations of ours: the environment each runs under.
ABLATIONS = {
    "ours-unpacked": (PREPACK_ENV, "0"),
    "ours-torch-linear": (CPU_LINEAR_ENV, "torch"),
    "ours-reference-attention": (ops.CPU_ATTENTION_ENV, "reference"),
}


def _timed(fn: Callable[[], dict[str, list[int]]]) -> tuple[float, dict[str, list[int]]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


OPTIONAL_SYSTEMS = frozenset({"hf-continuous"})


def _attempt(name: str, fn: Callable[[], Any], unsupported: dict[str, str]) -> Any:
    """``fn()``; for an optional system (HF's continuous batching, which not every family
    supports) an exception is recorded in ``unsupported`` (and None returned) instead."""
    if name not in OPTIONAL_SYSTEMS:
        return fn()
    try:
        return fn()
    except Exception as e:
        unsupported[name] = f"{type(e).__name__}: {e}".splitlines()[0][:120].replace("|", "/")
        return None


def run_hf_static(model: Any, reqs: list[Req], pad_id: int) -> dict[str, list[int]]:
    return {r.req_id: t for r, t in zip(reqs, hf_batch(model, reqs, pad_id), strict=True)}


def run_hf_continuous(model: Any, reqs: list[Req]) -> dict[str, list[int]]:
    n = reqs[0].max_tokens
    config = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, use_cuda_graph=False
    )
    out = model.generate_batch(
        [r.prompt for r in reqs], generation_config=config, progress_bar=False, warmup=False
    )
    # Results come keyed by request id in submission order.
    return {
        r.req_id: list(o.generated_tokens)[: r.max_tokens]
        for r, o in zip(reqs, out.values(), strict=True)
    }


class _Timers:
    """Wall time in the attention op and in linear layers (``ops.linear``, the packed
    projections, and ``torch.nn.functional.linear`` called elsewhere, e.g. by MoE experts)
    while installed (the CPU runs each op synchronously, so wall time is the op's time)."""

    def __init__(self) -> None:
        self.attention = self.linear = 0.0
        self._in_linear = False

    def _timed(self, fn: Callable[..., Any], field: str) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if field == "linear" and self._in_linear:  # ops.linear calling F.linear
                return fn(*a, **k)
            t0 = time.perf_counter()
            self._in_linear = field == "linear"
            try:
                return fn(*a, **k)
            finally:
                self._in_linear = False
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)

        return timed

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved = ops.paged_attention, ops.linear, torch.nn.functional.linear
        packed = PackedLinear.__call__  # the decoder's projections packed at load
        ops.paged_attention = self._timed(saved[0], "attention")
        ops.linear = self._timed(saved[1], "linear")
        torch.nn.functional.linear = self._timed(saved[2], "linear")
        PackedLinear.__call__ = self._timed(packed, "linear")  # type: ignore[method-assign]
        try:
            yield
        finally:
            ops.paged_attention, ops.linear, torch.nn.functional.linear = saved
            PackedLinear.__call__ = packed  # type: ignore[method-assign]


def decode_breakdown(system: EngineSystem, reqs: list[Req], num_seqs: int) -> dict[str, float]:
    """Mean ms per pure-decode step of ``num_seqs`` sequences: forward (the model's run, the
    batch built before it), attention, linear, the rest of the forward, and the engine's host
    work."""
    timers = _Timers()
    timer = system.timer  # the engines' runner hook: each forward, with the ops' time in it
    timer.records.clear()
    timer.probe = lambda: (timers.attention, timers.linear)
    timer.enabled = True
    try:
        with timers.installed():
            res = run_ours(system, [reqs], pad_to_batch_max=False)
    finally:
        timer.enabled, timer.probe = False, None
    steps = [(r.seconds, *r.deltas) for r in timer.decode(num_seqs)]  # forward, att, lin
    timer.records.clear()
    if not steps:
        raise RuntimeError(f"no pure-decode step of {num_seqs} sequences")
    fwd, att, lin = (1e3 * statistics.fmean(x) for x in zip(*steps, strict=True))
    return {
        "steps": len(steps),
        "forward": fwd,
        "attention": att,
        "linear": lin,
        "rest": fwd - att - lin,
        "host": 1e3 * statistics.fmean(res.host_s),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_logging("cpu_bench", "ERROR")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    max_len = args.max_prompt + max(hi for _, hi in WORKLOADS.values())
    failed = False
    with tempfile.TemporaryDirectory(prefix="cpu_bench_") as tmp:
        model_dir = write_model(Path(tmp) / "model", args, max_len)
        dtype = getattr(torch, args.dtype)
        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa"
        ).eval()
        hf.generation_config.eos_token_id = None  # ignore_eos, as ours
        pad_id = int(hf.config.pad_token_id)
        vocab = hf.config.vocab_size
        n_params = sum(p.numel() for p in hf.parameters())
        has_cb = hasattr(hf, "generate_batch")
        ours = our_system(
            model_dir, max_len, 4096, 256, None, dtype=args.dtype, cpu_threads=args.threads
        )
        variants = {}  # name -> our engine with one more executor flag
        for name, flags in (
            (f"ours-{args.quantization}", {"quantization": args.quantization}),
            (f"ours-kv-{args.kv_cache_dtype}", {"kv_cache_dtype": args.kv_cache_dtype}),
        ):
            if all(flags.values()):
                variants[name] = our_system(
                    model_dir,
                    max_len,
                    4096,
                    256,
                    None,
                    dtype=args.dtype,
                    cpu_threads=args.threads,
                    **flags,
                )
        torch.set_num_threads(args.threads)
        print(
            f"# CPU bench: {describe_model(args, hf)}, {n_params / 1e6:.2f} M parameters, "
            f"{args.dtype}, {args.num_requests} "
            f"requests at t=0, prompts {args.min_prompt}-{args.max_prompt}, greedy, "
            f"ignore_eos; {args.threads} torch threads; medians of {args.repeats} repeats\n"
        )
        print("| workload | system | output tok/s | ours / this | greedy mismatches vs HF |")
        print("|---|---|---:|---:|---:|")
        for workload in args.workloads.split(","):
            reqs = _requests(args, workload, vocab)
            total = sum(r.max_tokens for r in reqs)
            systems: dict[str, Callable[[], dict[str, list[int]]]] = {
                "ours": lambda reqs=reqs: run_ours(ours, [reqs], pad_to_batch_max=False).outputs,
                "hf-static": lambda reqs=reqs: run_hf_static(hf, reqs, pad_id),
            }
            for variant, system in variants.items():
                systems[variant] = lambda reqs=reqs, system=system: (
                    run_ours(system, [reqs], pad_to_batch_max=False).outputs
                )

            for name, (variable, value) in ABLATIONS.items():

                def ablation(
                    reqs: list[Req] = reqs, variable: str = variable, value: str = value
                ) -> dict[str, list[int]]:
                    with _env(variable, value):
                        return run_ours(ours, [reqs], pad_to_batch_max=False).outputs

                systems[name] = ablation
            if has_cb and len({r.max_tokens for r in reqs}) == 1:
                systems["hf-continuous"] = lambda reqs=reqs: run_hf_continuous(hf, reqs)
            walls: dict[str, list[float]] = {name: [] for name in systems}
            outs: dict[str, dict[str, list[int]]] = {}
            unsupported: dict[str, str] = {}  # optional systems that raised: why
            for name, fn in systems.items():  # warm-up, outside the timing
                _attempt(name, fn, unsupported)
            for _ in range(args.repeats):
                for name, fn in systems.items():
                    if name not in unsupported:
                        res = _attempt(name, lambda fn=fn: _timed(fn), unsupported)
                        if res is not None:
                            wall, outs[name] = res
                            walls[name].append(wall)
            ids = [r.req_id for r in reqs]
            rate = {n: total / statistics.median(w) for n, w in walls.items() if w}
            for name in systems:
                if name in unsupported:
                    print(f"| {workload} | {name} | n/a ({unsupported[name]}) | - | - |")
                    continue
                bad = mismatches(outs[name], outs["hf-static"], ids)
                failed |= bad > 0 and name == "ours" and args.dtype == "float32"
                ratio = "-" if name == "ours" else f"{rate['ours'] / rate[name]:.2f}x"
                print(f"| {workload} | {name} | {rate[name]:.0f} | {ratio} | {bad} |")
        print()
        reqs = _requests(args, "fixed", vocab)
        for name, env in {"ours": None, **ABLATIONS}.items():
            with _env(*env) if env else nullcontext():
                b = decode_breakdown(ours, reqs, args.num_requests)
            print(
                f"- decode step at {args.num_requests} sequences, {name} "
                f"(mean of {b['steps']:.0f} steps): forward {b['forward']:.2f} ms = attention "
                f"{b['attention']:.2f} + linear {b['linear']:.2f} + rest {b['rest']:.2f}; "
                f"host {b['host']:.2f} ms a step (mean over the run)"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
