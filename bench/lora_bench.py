"""Multi-LoRA serving on the CPU: the base model alone against 1, 4 and 16 adapters in one
batch, and against merging each adapter into its own copy of the model, all in the same run.

The model is the CPU benches' random Llama (``bench.common.models.CPU_MODEL``: hidden 512, 4
layers); the adapters are random PEFT adapters of rank ``--rank`` on every attention and MLP
projection (``pagedserve.tools.lora_adapter``), written once under ``--fixture-dir``.

The workload: ``--requests`` prompts of 32-96 random tokens, greedy, ``ignore_eos``,
``--max-tokens`` each, all submitted at once; with N adapters, request i names adapter
i mod N. For each N:

- **multi-LoRA**: one engine (``--enable-lora --max-loras N --max-lora-rank R``) serves every
  request, adapters mixed in each batch;
- **merged**: each adapter merged into its own copy of the model (PEFT's
  ``merge_and_unload``), served one after the other, each with its share of the requests
  (model loading not counted: the time is only that of generating).

Reported: output tok/s (median of ``--repeats``, interleaved), the ratio to the base model
alone (no ``--enable-lora``) and the ratio multi-LoRA / merged; and how many requests gave
the same tokens both ways (merging rounds differently: a random model's near-ties may flip).

Usage: ``python -m bench.lora_bench [--adapters 1,4,16] [--rank 16] [--requests 64]
[--max-tokens 64] [--repeats 3] [--threads N] [--json]``
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
from pathlib import Path

import torch
import transformers

from bench.common.engines import EngineSystem, greedy, run_requests
from bench.common.models import CPU_MODEL, cpu_engine_config, write_cpu_model
from pagedserve.tools.lora_adapter import write_random_adapter
from services.common.logging import configure_logging
from services.executor.api import LoRAConfig, LoRAModulePath, available_cores

MAX_ADAPTERS = 16


def write_fixture(root: Path, rank: int) -> tuple[Path, list[Path], list[Path]]:
    """The base model, ``MAX_ADAPTERS`` adapters of ``rank`` and each merged into a copy of
    the model, under ``root`` (written once)."""
    base = root / "base"
    if not (base / "config.json").is_file():
        write_cpu_model(base)
    adapters, merged = [], []
    for i in range(MAX_ADAPTERS):
        adapter = root / f"adapter-r{rank}-{i}"
        if not (adapter / "adapter_config.json").is_file():
            write_random_adapter(base, adapter, rank=rank, alpha=2 * rank, seed=100 + i)
        adapters.append(adapter)
        out = root / f"merged-r{rank}-{i}"
        if not (out / "config.json").is_file():
            _merge(base, adapter, out)
        merged.append(out)
    return base, adapters, merged


def _merge(base: Path, adapter: Path, out: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    for file in base.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(file, out / file.name)


def _requests(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1, *(rng.randrange(3, vocab) for _ in range(rng.randrange(32, 97)))] for _ in range(num)
    ]


def _run(
    system: EngineSystem, prompts: list[tuple[str, list[int], str]], max_tokens: int
) -> tuple[float, dict[str, list[int]]]:
    """Wall seconds and tokens of ``(id, prompt, adapter)`` requests, all submitted at once."""
    with system.engine() as engine:
        for rid, prompt, adapter in prompts:
            engine.submit(prompt, greedy(max_tokens), request_id=rid, lora_name=adapter)
        run = run_requests(engine, [])
    return run.wall_s, run.tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.lora_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="1,4,16", help="adapter counts, each <= 16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=available_cores())
    p.add_argument("--fixture-dir", type=Path, default=Path("/tmp/pagedserve-lora-bench"))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.adapters.split(",")]
    if any(not 1 <= n <= MAX_ADAPTERS for n in counts):
        p.error(f"--adapters: counts in [1, {MAX_ADAPTERS}]")
    configure_logging("lora_bench", "ERROR")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    base, adapters, merged = write_fixture(args.fixture_dir, args.rank)
    prompts = _requests(args.requests, vocab=600)
    tokens_out = args.requests * args.max_tokens

    def config(model: Path, lora: LoRAConfig | None = None):  # type: ignore[no-untyped-def]
        flags = {"max_num_seqs": args.requests}
        return cpu_engine_config(model, args.threads, lora=lora or LoRAConfig(), **flags)

    base_system = EngineSystem(config(base))
    systems = {
        n: EngineSystem(
            config(
                base,
                LoRAConfig(
                    enable_lora=True,
                    max_loras=n,
                    max_lora_rank=args.rank,
                    lora_modules=tuple(LoRAModulePath(f"a{i}", str(adapters[i])) for i in range(n)),
                ),
            )
        )
        for n in counts
    }
    merged_systems = [EngineSystem(config(m)) for m in merged[: max(counts)]]
    base_s: list[float] = []
    lora_s: dict[int, list[float]] = {n: [] for n in counts}
    merged_s: dict[int, list[float]] = {n: [] for n in counts}
    agree: dict[int, int] = {}
    base_requests = [(f"r{i}", p_, "") for i, p_ in enumerate(prompts)]
    _run(base_system, base_requests, args.max_tokens)  # warm-up (first-touch, allocators)
    for _ in range(args.repeats):
        base_s.append(_run(base_system, base_requests, args.max_tokens)[0])
        for n in counts:
            mixed = [(f"r{i}", p_, f"a{i % n}") for i, p_ in enumerate(prompts)]
            wall, lora_tokens = _run(systems[n], mixed, args.max_tokens)
            lora_s[n].append(wall)
            total, merged_tokens = 0.0, {}
            for j in range(n):
                share = [(rid, p_, "") for rid, p_, a in mixed if a == f"a{j}"]
                wall, toks = _run(merged_systems[j], share, args.max_tokens)
                total += wall
                merged_tokens.update(toks)
            merged_s[n].append(total)
            agree[n] = sum(lora_tokens[r] == merged_tokens[r] for r in lora_tokens)
    base_tps = tokens_out / statistics.median(base_s)
    rows = []
    for n in counts:
        lora_tps = tokens_out / statistics.median(lora_s[n])
        merged_tps = tokens_out / statistics.median(merged_s[n])
        rows.append(
            {
                "adapters": n,
                "lora_tok_s": round(lora_tps, 1),
                "vs_base": round(lora_tps / base_tps, 3),
                "merged_tok_s": round(merged_tps, 1),
                "lora_vs_merged": round(lora_tps / merged_tps, 3),
                "same_tokens_as_merged": f"{agree[n]}/{args.requests}",
            }
        )
    result = {
        "model": CPU_MODEL,
        "rank": args.rank,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "base_tok_s": round(base_tps, 1),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"base alone: {base_tps:.0f} tok/s ({args.requests} requests x {args.max_tokens} "
        f"tokens, {args.threads} threads, rank {args.rank})"
    )
    print(f"{'adapters':>8} {'multi-LoRA':>11} {'vs base':>8} {'merged':>8} {'LoRA/merged':>12}")
    for r in rows:
        print(
            f"{r['adapters']:>8} {r['lora_tok_s']:>11.0f} {r['vs_base']:>8.3f} "
            f"{r['merged_tok_s']:>8.0f} {r['lora_vs_merged']:>12.3f}  "
            f"(same tokens as merged: {r['same_tokens_as_merged']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
