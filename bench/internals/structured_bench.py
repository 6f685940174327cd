"""What structured outputs cost per decode step: the in-process engine at 64 running
sequences, unconstrained against a JSON schema, on this CPU.

The model is ``bench.cpu_bench``'s random Llama (hidden 512, 4 layers, 8 query / 2 KV heads,
MLP 1024, the tiny tokenizer's 621-token vocabulary, fp32). 64 requests at t=0 with prompts
of 35-254 random tokens, greedy, 64 output tokens each: ``unconstrained`` with
``ignore_eos``; ``json`` under a schema that cannot be complete within 64 tokens (an array of
at least 50 objects with a bounded string, an integer and a boolean), so that every sample
decodes all 64 steps under its grammar. Reported per system: the median wall time of
``Engine.step()`` over the steps where all 64 sequences decode (one token each), and, for
``json``, the time spent filling and applying the token bitmasks in those steps; medians of
``--repeats`` interleaved runs. Every ``json`` output is checked to be a prefix the grammar
accepts (the engine would have refused a token otherwise).

Usage: ``python -m bench.internals.structured_bench [--repeats 3] [--threads N]``. Not a test:
prints markdown.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.models import cpu_engine_config, write_cpu_model
from bench.common.workloads import random_prompts
from services.blockmgr.client import InProcessClient
from services.common.logging import configure_logging
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredKind, StructuredOutputs
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.model.runner_config import available_cores
from services.executor.service.startup import build_engine

SCHEMA = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "count", "ok"],
        "additionalProperties": False,
    },
}
NUM_SEQS = 64
MAX_TOKENS = 64


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    mask_s = 0.0
    grammars = engine.grammars
    assert grammars is not None
    mask_logits = grammars.mask_logits

    def timed_mask(logits: torch.Tensor, rows: dict[int, Any]) -> None:
        nonlocal mask_s
        t0 = time.perf_counter()
        mask_logits(logits, rows)
        mask_s += time.perf_counter() - t0

    grammars.mask_logits = timed_mask  # type: ignore[method-assign]
    steps: list[float] = []
    masks: list[float] = []
    outputs: dict[str, list[int]] = {}
    try:
        while engine.has_work:
            running = engine.scheduler.running
            decoding = len(running) == NUM_SEQS and all(s.num_output_tokens for s in running)
            before, t0 = mask_s, time.perf_counter()
            for out in engine.step():
                outputs.setdefault(out.req_id.request_id, []).extend(out.token_ids)
            if decoding:
                steps.append(time.perf_counter() - t0)
                masks.append(mask_s - before)
    finally:
        del grammars.mask_logits
    assert all(len(o) == MAX_TOKENS for o in outputs.values()), "a sample ended early"
    return {"step": statistics.median(steps), "mask": statistics.median(masks), "n": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=available_cores())
    args = ap.parse_args()
    configure_logging("structured_bench", "ERROR")
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="structured_bench_") as tmp:
        model = write_cpu_model(Path(tmp) / "model")
        config = cpu_engine_config(model, args.threads, num_kv_blocks=2048)
        runner = build_runner(config.runner_config())
        vocab = runner.config.vocab_size
        prompts = random_prompts(rng, vocab, NUM_SEQS)
        systems = {
            "unconstrained": SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
            ),
            "json": SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                structured_outputs=StructuredOutputs(StructuredKind.JSON, json.dumps(SCHEMA)),
            ),
        }
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for rep in range(args.repeats + 1):  # the first round warms up
            for name, params in systems.items():
                engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
                res = _run(engine, prompts, params)
                if rep:
                    results[name].append(res)
    step = {n: 1e3 * statistics.median(r["step"] for r in rs) for n, rs in results.items()}
    mask = {n: 1e3 * statistics.median(r["mask"] for r in rs) for n, rs in results.items()}
    print(
        f"# structured outputs: {NUM_SEQS} sequences decoding, {args.threads} threads, "
        f"vocabulary {vocab}, medians of {args.repeats} runs\n"
    )
    print("| system | decode step (ms) | bitmask fill + apply (ms) | vs unconstrained |")
    print("|---|---:|---:|---:|")
    for name in systems:
        ratio = step[name] / step["unconstrained"] - 1
        print(f"| {name} | {step[name]:.2f} | {mask[name]:.2f} | {ratio:+.1%} |")


if __name__ == "__main__":
    main()
