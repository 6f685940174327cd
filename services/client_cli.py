"""``pagedserve generate`` and ``pagedserve chat``: stream a generation to the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="localhost:50051", help="gateway host:port")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-n", type=int, default=None, help="parallel samples")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect with TLS")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--usage", action="store_true", help="print token usage at the end")


def _params(a: argparse.Namespace) -> generation_pb2.SamplingParams:
    sp = generation_pb2.SamplingParams(max_tokens=a.max_tokens, stop=a.stop)
    for field, value in (
        ("temperature", a.temperature),
        ("top_p", a.top_p),
        ("top_k", a.top_k),
        ("seed", a.seed),
        ("n", a.n),
    ):
        if value is not None:
            setattr(sp, field, value)
    return sp


# What a client should do with UNAVAILABLE (no executor serving, a restart): retry with
# back-off. Streams are retried only before their first response, as gRPC does.
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "pagedserve.v1.Generation"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.5s",
                    "maxBackoff": "4s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS = [("grpc.service_config", RETRY_SERVICE_CONFIG), ("grpc.enable_retries", 1)]


def _stream(a: argparse.Namespace, request: generation_pb2.GenerateRequest) -> int:
    """Stream one request to the terminal. One sample streams as it comes; with ``-n`` > 1
    each sample is printed whole, as ``[i] text``, once it has finished (their chunks
    interleave on the wire)."""
    if a.tls_ca:
        with open(a.tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(f.read())
        channel = grpc.secure_channel(a.address, credentials, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(a.address, options=CHANNEL_OPTIONS)
    metadata = [("authorization", f"Bearer {a.api_key}")] if a.api_key else None
    stub = generation_pb2_grpc.GenerationStub(channel)
    multi = (a.n or 1) > 1
    samples: dict[int, list[str]] = {}  # index -> its text so far (``-n`` > 1)
    try:
        for resp in stub.Generate(request, metadata=metadata, timeout=a.timeout):
            finished = resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            if multi:
                samples.setdefault(resp.index, []).append(resp.text)
                if finished:
                    _print_sample(resp.index, samples.pop(resp.index))
            else:
                sys.stdout.write(resp.text)
                sys.stdout.flush()
            if finished and a.usage:
                u = resp.usage
                reason = common_pb2.FinishReason.Name(resp.finish_reason)
                after_text = "" if multi else "\n"  # a streamed sample ends without one
                print(
                    f"{after_text}[{resp.index}] {reason} prompt={u.prompt_tokens} "
                    f"completion={u.completion_tokens} cached={u.cached_prompt_tokens}",
                    file=sys.stderr,
                )
        _print_unfinished(samples)
        if not multi:
            sys.stdout.write("\n")
        return 0
    except grpc.RpcError as exc:
        _print_unfinished(samples)  # what the samples had before the error
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        channel.close()


def _print_sample(index: int, chunks: list[str]) -> None:
    sys.stdout.write(f"[{index}] {''.join(chunks)}\n")
    sys.stdout.flush()


def _print_unfinished(samples: dict[int, list[str]]) -> None:
    for index in sorted(samples):
        _print_sample(index, samples.pop(index))


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pagedserve generate", description="Stream a completion of PROMPT."
    )
    p.add_argument("prompt")
    _common(p)
    a = p.parse_args(argv)
    return _stream(a, generation_pb2.GenerateRequest(prompt=a.prompt, sampling_params=_params(a)))


def chat_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pagedserve chat",
        description="Send chat messages (rendered with the model's chat template). With no "
        "MESSAGE, read user turns from stdin, one per line, keeping the history.",
    )
    p.add_argument("message", nargs="?")
    p.add_argument("--system", default=None, help="system prompt")
    _common(p)
    a = p.parse_args(argv)
    history: list[generation_pb2.ChatMessage] = []
    if a.system:
        history.append(generation_pb2.ChatMessage(role="system", content=a.system))
    turns = [a.message] if a.message is not None else (line.rstrip("\n") for line in sys.stdin)
    code = 0
    for turn in turns:
        history.append(generation_pb2.ChatMessage(role="user", content=turn))
        request = generation_pb2.GenerateRequest(
            messages=generation_pb2.ChatMessages(messages=history), sampling_params=_params(a)
        )
        code = _stream(a, request)
    return code
