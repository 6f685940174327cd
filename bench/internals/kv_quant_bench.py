"""A quantized KV cache (and int8 weights) against fp32, in one run, on the CPU:

    .venv/bin/python -m bench.internals.kv_quant_bench [--kv-cache-dtypes bfloat16,fp8,int8]

A random Llama (hidden 512, 4 layers, 8 query / 2 KV heads of 64, MLP 1024: the CPU bench's
model) in fp32 on ``--threads`` torch threads; each row is one ``--kv-cache-dtype`` (and a
row of ``--quantization int8`` weights over an fp32 cache), every figure beside ``auto``
(fp32) measured in the same run (``fp8+calc``: with ``--calculate-kv-scales``; the random
model's K/V exceed e4m3's range, so scales of 1.0 saturate):

- **capacity**: the blocks ``--kv-cache-memory`` holds and the max concurrency at
  ``--max-model-len`` (as the executor sizes and logs them);
- **fill**: ``--num-requests`` requests at once, prompts 256-448 tokens, 64 greedy output
  tokens each, in a KV memory of ``--fill-blocks`` fp32 blocks (too few for them all in
  fp32): output tok/s and preemptions;
- **decode step**: one forward of 64 decode rows with contexts of 512-2,048 tokens over
  their own blocks (median of ``--steps``), the cache filled with random K/V in its dtype;
- **accuracy**: 8 prompts of 128 tokens and fp32's 64 greedy tokens after each, scored
  teacher-forced (all logits read back through the cache): top-1 agreement with fp32 per
  position, the mean KL divergence of the next-token distributions (fp32's || ours), and
  how many of the 8 greedy continuations differ from fp32's (and where the first differs).

``--model DIR`` takes another checkpoint, e.g. the trained copy model of
``bench.common.trained``. Random weights make a chaotic model (even a bf16 cache flips its
top token on several percent of positions): its figures bound the error, a trained model's
say more. Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedserve.kernels import kv_quant
from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.client import InProcessClient
from services.common.blocks import usable_blocks
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.config import ModelConfig
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.kv_cache import (
    KV_CACHE_DTYPES,
    bytes_per_block,
    num_blocks_for_budget,
)
from services.executor.model.launch import build_runner
from services.executor.model.runner import ModelRunner
from services.executor.service import startup
from services.executor.service.config import ExecutorConfig

SIZES = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
}
BLOCK_SIZE = 16


def config(args: argparse.Namespace, model: str, variant: str, **extra: Any) -> ExecutorConfig:
    kv, quantization = ("auto", "int8") if variant == "int8-weights" else (variant, None)
    if kv.endswith("+calc"):  # fp8 with --calculate-kv-scales
        kv, extra = kv.removesuffix("+calc"), {"calculate_kv_scales": True} | extra
    fields: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "device": "cpu",
        "block_size": BLOCK_SIZE,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,
        "cpu_threads": args.threads,
        "kv_cache_dtype": kv,
        "quantization": quantization,
    }
    return ExecutorConfig(**(fields | extra))


def engine(cfg: ExecutorConfig) -> Engine:
    built, _ = startup.build_engine(
        cfg, runner=build_runner(cfg.runner_config()), blockmgr=InProcessClient()
    )
    return built


def fill(args: argparse.Namespace, model: str, variant: str, memory: int) -> dict[str, Any]:
    eng = engine(config(args, model, variant, kv_cache_memory=memory))
    rng = random.Random(args.seed)
    vocab = eng.settings.vocab_size
    for i in range(args.num_requests):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(255, 448))]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        eng.add_request(RequestKey(0, f"r{i}"), prompt, params)
    start = time.perf_counter()
    while eng.has_work:
        eng.step()
    wall = time.perf_counter() - start
    return {
        "blocks": usable_blocks(eng.runner.num_blocks),
        "tok_s": args.num_requests * 64 / wall,
        "preemptions": eng.scheduler.num_preemptions,
    }


def decode_step(args: argparse.Namespace, runner: ModelRunner) -> float:
    """Median seconds of one forward of 64 decode rows, contexts 512-2,048."""
    rng = random.Random(args.seed)
    contexts = [rng.randrange(512, 2048) for _ in range(64)]  # + 1 token: max_model_len 2048
    cache = runner.kv_cache
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(*cache.shape[:-1], kv_quant.head_dim_of(cache), generator=gen)
    cache.copy_(kv_quant.encode(values, cache.dtype))
    chunks, next_block = [], 1
    for ctx in contexts:
        n = ctx // BLOCK_SIZE + 1
        table = list(range(next_block, next_block + n))
        next_block += n
        chunks.append(SeqChunk([5], ctx, table, True))
    times = []
    for i in range(args.steps + 2):
        start = time.perf_counter()
        runner.execute(chunks)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def accuracy(
    runner: ModelRunner, base: ModelRunner, prompts: list[list[int]], greedy: list[list[int]]
) -> dict[str, float]:
    """Teacher-forced over fp32's greedy continuations: top-1 agreement, mean KL."""
    agree, kl, n = 0.0, 0.0, 0
    for prompt, cont in zip(prompts, greedy, strict=True):
        tokens = prompt + cont
        table = list(range(1, len(tokens) // BLOCK_SIZE + 2))
        ours = runner.execute([SeqChunk(tokens, 0, table, True, all_logits=True)])
        ref = base.execute([SeqChunk(tokens, 0, table, True, all_logits=True)])
        ours, ref = ours[len(prompt) - 1 :].double(), ref[len(prompt) - 1 :].double()
        agree += (ours.argmax(-1) == ref.argmax(-1)).sum().item()
        logp, logq = ref.log_softmax(-1), ours.log_softmax(-1)
        kl += (logp.exp() * (logp - logq)).sum(-1).sum().item()
        n += ours.shape[0]
    return {"top1": agree / n, "kl": kl / n}


def generate(args: argparse.Namespace, model: str, variant: str, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    eng = engine(config(args, model, variant, num_kv_blocks=2048))
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        eng.add_request(RequestKey(0, f"p{i}"), prompt, params)
    got: dict[str, list[int]] = {}
    while eng.has_work:
        for o in eng.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    return [got[f"p{i}"] for i in range(len(prompts))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--kv-cache-dtypes",
        default="bfloat16,fp8,fp8+calc,fp8_e5m2,int8",
        help="NAME+calc: with --calculate-kv-scales",
    )
    p.add_argument(
        "--model",
        help="a checkpoint directory instead of the random Llama, e.g. the trained fixture "
        "(`python -m bench.common.trained --out DIR`, then DIR/target)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=256 * 2**20)
    p.add_argument("--fill-blocks", type=int, default=1200, help="fill: KV memory, fp32 blocks")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    variants = ["auto", *args.kv_cache_dtypes.split(","), "int8-weights"]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_tiny_model(Path(tmp) / "llama", arch="llama", **SIZES))
        mc = ModelConfig.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
        fill_memory = args.fill_blocks * bytes_per_block(mc, BLOCK_SIZE, torch.float32)
        rng = random.Random(args.seed + 1)
        prompts = [[1] + [rng.randrange(3, mc.vocab_size) for _ in range(127)] for _ in range(8)]
        greedy = {v: generate(args, model, v, prompts) for v in variants}
        base_cfg = config(args, model, "auto", num_kv_blocks=64, max_model_len=512)
        base = build_runner(base_cfg.runner_config())
        rows = {}
        for variant in variants:
            dtype = KV_CACHE_DTYPES.get(variant.removesuffix("+calc"), torch.float32)
            per_seq = -(-args.max_model_len // BLOCK_SIZE)
            capacity = usable_blocks(
                num_blocks_for_budget(mc, BLOCK_SIZE, dtype, args.kv_cache_memory)
            )
            timed = build_runner(
                config(args, model, variant, num_kv_blocks=64 * 130 + 1).runner_config()
            )
            step = decode_step(args, timed)
            del timed
            small = build_runner(
                config(args, model, variant, num_kv_blocks=64, max_model_len=512).runner_config()
            )
            rows[variant] = {
                "capacity": capacity,
                "concurrency": capacity / per_seq,
                "step": step,
                "fill": fill(args, model, variant, fill_memory),
                "accuracy": accuracy(small, base, prompts, greedy["auto"]),
                "differ": [
                    next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), None)
                    for g, r in zip(greedy[variant], greedy["auto"], strict=True)
                ],
            }
    auto = rows["auto"]
    shape = (
        f"{mc.hidden_size} hidden, {mc.num_layers} layers, {mc.num_heads}/{mc.num_kv_heads} "
        f"heads of {mc.head_dim}"
    )
    print(
        f"## KV cache dtypes, {args.threads} threads: {args.model or 'random Llama'} ({shape}); "
        f"capacity in {args.kv_cache_memory / 2**20:.0f} MiB at "
        f"max_model_len {args.max_model_len}; fill: {args.num_requests} requests in "
        f"{args.fill_blocks} fp32 blocks' memory; decode step: 64 rows, contexts 512-2,048\n"
    )
    print(
        "| --kv-cache-dtype | blocks | x fp32 | max concurrency | fill tok/s | x fp32 | "
        "preemptions | decode step ms | x fp32 | top-1 agreement | mean KL | greedy "
        "continuations differing (first position) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for variant, r in rows.items():
        differ = [d for d in r["differ"] if d is not None]
        name = "auto (fp32)" if variant == "auto" else variant
        if variant == "int8-weights":
            name = "auto, --quantization int8"
        print(
            f"| {name} | {r['capacity']:,} | {r['capacity'] / auto['capacity']:.2f}x | "
            f"{r['concurrency']:.1f} | {r['fill']['tok_s']:,.0f} | "
            f"{r['fill']['tok_s'] / auto['fill']['tok_s']:.2f}x | {r['fill']['preemptions']} | "
            f"{r['step'] * 1e3:.1f} | {r['step'] / auto['step']:.2f}x | "
            f"{r['accuracy']['top1']:.1%} | {r['accuracy']['kl']:.2e} | "
            f"{len(differ)}/8 ({', '.join(map(str, differ)) or '-'}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
