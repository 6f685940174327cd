"""How fast a lost tensor-parallel rank is noticed: an executor at ``--tensor-parallel-size 2``
behind a gateway (real processes, tiny model, CPU); rank 1 is killed with SIGKILL, once while
a client streams and once while the executor is idle. Reports when the client got UNAVAILABLE
(the gateway runs with ``--max-resumes 0``: the stream ends when the executor ends it) and
when the executor exited (with its status).

    .venv/bin/python -m bench.tp_rank_loss [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import grpc

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc


def one_run(model: Path, streaming: bool) -> tuple[float | None, float, int]:
    args = ["executor", "--model", str(model), "--port", "0", "--dtype", "float32"]
    args += ["--num-kv-blocks", "256", "--max-model-len", "512", "--tensor-parallel-size", "2"]
    executor = ServiceProcess(args, "executor_ready")
    # --max-resumes 0: the client sees the executor's streams end (else the gateway would
    # hold them for a restart that this bench does not do).
    gateway = ServiceProcess(
        gateway_args(model, executor.address, "--max-resumes", "0"), "gateway_listening"
    )
    try:
        wait_serving(gateway.address)
        (pid,) = executor.wait_for_event("tensor_parallel_started")["worker_pids"]
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        params = G.SamplingParams(max_tokens=450, temperature=0, ignore_eos=True)
        stream = None
        if streaming:
            stream = stub.Generate(G.GenerateRequest(prompt="Once upon", sampling_params=params))
            next(stream)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        client_s = None
        if stream is not None:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                client_s = time.monotonic() - t0
        code = executor.proc.wait(30)
        return client_s, time.monotonic() - t0, code
    finally:
        gateway.stop()
        executor.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-llama")
        print("| case | client UNAVAILABLE after | executor exit status | exited after |")
        print("|---|---:|---:|---:|")
        for streaming in (True, False):
            for _ in range(args.repeats):
                client_s, exit_s, code = one_run(model, streaming)
                client = f"{client_s * 1e3:.0f} ms" if client_s is not None else "-"
                case = "mid-stream" if streaming else "idle"
                print(f"| {case} | {client} | {code} | {exit_s:.2f} s |")


if __name__ == "__main__":
    main()
