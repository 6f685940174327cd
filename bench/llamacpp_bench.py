"""pagedserve against llama.cpp's ``llama-server`` on the CPU: the same checkpoint (converted
to GGUF), the same requests, the same client, fresh servers interleaved.

Given a built llama.cpp tree (``--llama-cpp DIR``: ``convert_hf_to_gguf.py``, ``gguf-py/``
and ``build/bin/llama-server`` / ``llama-tokenize``; how to build it: docs/benchmarks.md), for
each model (``--models small,large``: the CPU benches' random Llama, hidden 512 and 4
layers, 9.6 M parameters; and one where matmuls dominate, hidden 1,536 and 16 layers,
0.4 B):

1. converts the checkpoint with that tree's converter (``--outtype f32``, and ``f16`` with
   ``--f16``), telling it the tiny tokenizer's BPE pre-tokenizer is GPT-2's, then checks
   that ``llama-tokenize`` gives the HF tokenizer's ids on sample texts;
2. checks greedy parity on 8 prompts: HF ``generate`` against each server's tokens;
3. runs each workload through ``pagedserve bench serve``'s OpenAI client on
   ``/v1/completions`` (streamed, token-id prompts, greedy, ``ignore_eos``), every system
   on a fresh server, ``--rounds`` times interleaved:
   - ``chat``: 64 requests at once, prompts 35-254 tokens, 64 output tokens each;
   - ``burst``: 200 requests at once, prompts 128, outputs 64;
   pagedserve with its defaults (``pagedserve serve``) and llama.cpp at each ``--np`` (slots;
   ``-t 2 -tb 2 --cont-batching``, each slot's context the longest request padded to 256);
4. prints the medians (output tok/s, mean TTFT and TPOT, tokens per CPU-second of the
   server processes) and each of ours (defaults, every ``--ours``) over the best llama.cpp
   of each file type (F32; F16 with ``--f16``; Q8_0 with ``--q8``).

Without ``--llama-cpp`` (or with a tree lacking the binaries) it prints why and exits 0:
nothing else depends on llama.cpp.

    .venv/bin/python -m bench.llamacpp_bench --llama-cpp /path/to/llama.cpp \\
        [--models small,large] [--workloads chat,burst] [--np 64,128] [--rounds 2] [--f16] \\
        [--ours "t1=--cpu-threads 1"]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common.models import CPU_MODEL, write_bench_model
from bench.common.serving import drive
from pagedserve.testing.procs import ROOT, free_ports
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.bench.backends import OpenAIBackend
from services.bench.datasets import BenchRequest, random_requests

VOCAB = 621  # the tiny tokenizer's
MODELS: dict[str, dict[str, Any]] = {
    "small": CPU_MODEL,
    "large": {
        "hidden_size": 1536,
        "num_layers": 16,
        "num_heads": 12,
        "num_kv_heads": 4,
        "intermediate_size": 4096,
    },
}
SAMPLE_TEXTS = ["Hello, world!", "The quick brown fox jumps over 13 lazy dogs.", "  spaced\ttabs"]
# The converter recognises a BPE pre-tokenizer by the hash of its output on a test text; the
# tiny tokenizer's is GPT-2's split (checked after conversion against llama-tokenize). It
# tries SentencePiece first, importing it before it looks for a tokenizer.model.
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
sys.path.insert(0, sys.argv[1])
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self, *args, **kwargs):  # (no tokenizer.model here: a BPE tokenizer)
    raise FileNotFoundError("tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
import convert_hf_to_gguf as convert
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert.main()
"""


@dataclass(frozen=True)
class LlamaCpp:
    root: Path

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def tokenize(self) -> Path:
        return self.root / "build" / "bin" / "llama-tokenize"

    def missing(self) -> str | None:
        for path in (self.root / "convert_hf_to_gguf.py", self.server, self.tokenize):
            if not path.exists():
                return f"{path} not found"
        return None

    def convert(self, model: Path, outtype: str, out: Path) -> Path:
        subprocess.run(
            [sys.executable, "-c", CONVERT, str(self.root), str(model), "--outtype", outtype,
             "--outfile", str(out)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return out

    def token_ids(self, gguf: Path, text: str) -> list[int]:
        out = subprocess.run(
            [str(self.tokenize), "-m", str(gguf), "-p", text, "--ids", "--log-disable"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return [int(t) for t in out.stdout.strip().splitlines()[-1].strip("[]").split(",")]


class Server:
    """A server process on a free loopback port, its HTTP API ready."""

    def __init__(
        self, args: list[str], port: int, grpc_address: str = "", env: dict[str, str] | None = None
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.grpc_address = grpc_address  # ours: the gateway's gRPC API
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:  # (models loaded)
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not serve within 300 s")
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        """User + system time of the server and its children (every service of ours)."""
        total = 0.0
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def ours(model: Path, executor_flags: Sequence[str] = ()) -> Server:
    """``pagedserve serve`` with ``executor_flags``; words ``VAR=VALUE`` among them (an
    upper-case name) go to the environment of its services instead."""
    env = dict(w.split("=", 1) for w in executor_flags if _is_env(w))
    executor_flags = [w for w in executor_flags if not _is_env(w)]
    port, grpc, ex, bm = free_ports(4)
    return Server(
        [sys.executable, "-m", "services.cli", "serve", "--model", str(model),
         "--http-port", str(port), "--port", str(grpc), "--executor-port", str(ex),
         "--blockmgr-port", str(bm), "--metrics-port", "-1", "--log-level", "ERROR",
         "--", *executor_flags],
        port,
        f"127.0.0.1:{grpc}",
        env,
    )  # fmt: skip


def _is_env(word: str) -> bool:
    name, eq, _ = word.partition("=")
    return bool(eq) and name.isupper() and not name.startswith("-")


def theirs(cpp: LlamaCpp, gguf: Path, slots: int, slot_len: int) -> Server:
    (port,) = free_ports(1)
    return Server(
        [str(cpp.server), "-m", str(gguf), "-t", "2", "-tb", "2", "-np", str(slots),
         "-c", str(slots * slot_len), "--cont-batching", "--host", "127.0.0.1",
         "--port", str(port), "--log-disable"],
        port,
    )  # fmt: skip


async def _drive(url: str, requests: list[BenchRequest]) -> dict[str, object]:
    backend = OpenAIBackend(f"{url}/v1/completions", f"{url}/v1/models", None, None)
    try:
        await backend.resolve_model()
    except BaseException:
        await backend.close()
        raise
    return await drive(backend, requests)


def measure(server: Server, requests: list[BenchRequest]) -> dict[str, float]:
    asyncio.run(_drive(server.url, requests[:4]))  # warm-up
    cpu0 = server.cpu_seconds()
    result = asyncio.run(_drive(server.url, requests))
    tokens = sum(r.output_len for r in requests)
    return {
        "tok/s": float(result["output_throughput"]),  # type: ignore[arg-type]
        "TTFT ms": float(result["mean_ttft_ms"]),  # type: ignore[arg-type]
        "TPOT ms": float(result["mean_tpot_ms"]),  # type: ignore[arg-type]
        "tok/CPU-s": tokens / max(1e-9, server.cpu_seconds() - cpu0),
    }


def greedy_tokens(server: Server, prompt: list[int], n: int) -> list[int]:
    """A server's greedy tokens for ``prompt``, ``ignore_eos``: llama.cpp's ``/completion``
    returns them; ours, its gRPC ``Generate``."""
    if not server.grpc_address:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                "return_tokens": True, "cache_prompt": False, "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{server.url}/completion", json=body, timeout=120)
        return list(r.json()["tokens"])
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling_params=generation_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]


def workload(name: str, seed: int, num: int | None = None) -> list[BenchRequest]:
    """The named workload, of ``num`` requests instead of its own count if given."""
    if name == "chat":  # prompts 35-254, exactly 64 output tokens
        reqs = random_requests(64 if num is None else num, 145, 64, 0.75, VOCAB, seed)
        return [replace(r, output_len=64) for r in reqs]
    if name == "burst":
        return random_requests(200 if num is None else num, 128, 64, 0.0, VOCAB, seed)
    raise SystemExit(f"--workloads: unknown workload {name!r} (chat, burst)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp tree")
    p.add_argument("--models", default="small")
    p.add_argument("--workloads", default="chat,burst")
    p.add_argument("--np", default="64", help="llama-server slot counts to run (-np)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--f16", action="store_true", help="llama.cpp on an F16 file too")
    p.add_argument("--q8", action="store_true", help="llama.cpp on a Q8_0 file too")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per workload instead of its own count (fewer for the large model)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ours",
        action="append",
        default=[],
        help="NAME=EXECUTOR FLAGS: pagedserve with those executor flags too (repeatable); "
        "words VAR=VALUE among them set the servers' environment instead (e.g. "
        '"torch-attention=PAGEDSERVE_CPU_NATIVE=0")',
    )
    args = p.parse_args(argv)
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be at least 1")
    if args.llama_cpp is None:
        print("skipped: no --llama-cpp tree given (see docs/benchmarks.md to build one)")
        return 0
    cpp = LlamaCpp(args.llama_cpp.resolve())
    if why := cpp.missing():
        print(f"skipped: {why} (see docs/benchmarks.md to build llama.cpp)")
        return 0
    slot_counts = [int(n) for n in args.np.split(",")]
    with tempfile.TemporaryDirectory(prefix="llamacpp_bench_") as tmp:
        for size in args.models.split(","):
            if size not in MODELS:
                raise SystemExit(f"--models: unknown model {size!r} (small, large)")
            model = write_bench_model(Path(tmp) / size, **MODELS[size])
            ggufs = {"F32": cpp.convert(model, "f32", Path(tmp) / f"{size}-f32.gguf")}
            if args.f16:
                ggufs["F16"] = cpp.convert(model, "f16", Path(tmp) / f"{size}-f16.gguf")
            if args.q8:
                ggufs["Q8_0"] = cpp.convert(model, "q8_0", Path(tmp) / f"{size}-q8_0.gguf")
            run_model(args, cpp, size, model, ggufs, slot_counts)
    return 0


def run_model(
    args: argparse.Namespace,
    cpp: LlamaCpp,
    size: str,
    model: Path,
    ggufs: dict[str, Path],
    slot_counts: list[int],
) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    same = all(tok(t).input_ids == cpp.token_ids(ggufs["F32"], t) for t in SAMPLE_TEXTS)
    params = sum(int(t.numel()) for t in AutoModelForCausalLM.from_pretrained(model).parameters())
    print(f"\n## {size} model: {params / 1e6:.1f} M parameters; GGUF tokenizer equals HF's: {same}")
    parity(model, cpp, ggufs, args.ours)
    for name in args.workloads.split(","):
        requests = workload(name, args.seed, args.num_requests)
        slot_len = -(-max(r.prompt_len + r.output_len for r in requests) // 256) * 256
        systems = [("pagedserve (defaults)", lambda: ours(model))]
        for variant in args.ours:
            name_, _, flags = variant.partition("=")
            systems.append((f"pagedserve {name_}", _ours(model, flags.split())))
        for kind, gguf in ggufs.items():
            for n in slot_counts:
                systems.append((f"llama.cpp {kind} -np {n}", _llama(cpp, gguf, n, slot_len)))
        runs: dict[str, list[dict[str, float]]] = {s: [] for s, _ in systems}
        for _ in range(args.rounds):
            for label, start in systems:
                server = start()
                try:
                    runs[label].append(measure(server, requests))
                finally:
                    server.stop()
        lens = [r.prompt_len for r in requests]
        print(
            f"\n### {name}: {len(requests)} requests at once, prompts {min(lens)}-{max(lens)}, "
            f"{requests[0].output_len} output tokens; medians of {args.rounds} rounds\n"
        )
        print("| server | output tok/s | TTFT ms | TPOT ms | tokens / CPU-s |")
        print("|---|---:|---:|---:|---:|")
        med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
        for label, m in med.items():
            print(f"| {label} | {m['tok/s']:,.0f} | {m['TTFT ms']:,.0f} | {m['TPOT ms']:.1f} | "
                  f"{m['tok/CPU-s']:,.0f} |")  # fmt: skip
        print()
        for kind in ggufs:
            best = max(m["tok/s"] for s, m in med.items() if f" {kind} " in s)
            for label, m in med.items():
                if label.startswith("pagedserve"):
                    print(f"{label} / best llama.cpp {kind}: {m['tok/s'] / best:.2f}x")


def _ours(model: Path, flags: list[str]) -> Callable[[], Server]:
    return lambda: ours(model, flags)


def _llama(cpp: LlamaCpp, gguf: Path, slots: int, slot_len: int) -> Callable[[], Server]:
    return lambda: theirs(cpp, gguf, slots, slot_len)


def parity(
    model: Path, cpp: LlamaCpp, ggufs: dict[str, Path], variants: list[str], n: int = 16
) -> None:
    """Greedy tokens of 8 prompts: HF's against each server's (``variants``: ``--ours``)."""
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompts = [[int(t) for t in r.prompt] for r in random_requests(8, 40, n, 0.5, VOCAB, 7)]
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    servers = [("pagedserve", lambda: ours(model))]
    for variant in variants:
        label, _, flags = variant.partition("=")
        servers.append((f"pagedserve {label}", _ours(model, flags.split())))
    for kind, gguf in ggufs.items():
        servers.append((f"llama.cpp {kind}", _llama(cpp, gguf, 1, 512)))
    line = []
    for label, start in servers:
        server = start()
        try:
            got = [greedy_tokens(server, p, n) for p in prompts]
        finally:
            server.stop()
        line.append(f"{label} {sum(g == e for g, e in zip(got, expected, strict=True))}/8")
    print("greedy tokens equal to HF's: " + ", ".join(line))


if __name__ == "__main__":
    sys.exit(main())
