"""Sending one benchmark request and timing what comes back, over gRPC or the OpenAI HTTP
API. A failure is recorded, never raised: the run goes on and counts it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.bench.datasets import BenchRequest


@dataclass
class RequestOutput:
    prompt_len: int
    start: float = 0.0  # perf_counter when sent
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between token messages
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens)


class GrpcBackend:
    def __init__(self, address: str, api_key: str | None) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def vocab_size(self) -> int:
        info = await self._stub.GetModelInfo(
            generation_pb2.GetModelInfoRequest(), metadata=self._metadata, timeout=30
        )
        return int(info.vocab_size)

    async def send(self, req: BenchRequest, ignore_eos: bool) -> RequestOutput:
        out = RequestOutput(req.prompt_len, start=time.perf_counter())
        request = generation_pb2.GenerateRequest(
            sampling_params=generation_pb2.SamplingParams(
                max_tokens=req.output_len, temperature=0, ignore_eos=ignore_eos
            )
        )
        if isinstance(req.prompt, str):
            request.prompt = req.prompt
        else:
            request.prompt_token_ids.ids.extend(req.prompt)
        last = out.start
        try:
            async for r in self._stub.Generate(request, metadata=self._metadata):
                now = time.perf_counter()
                if r.token_ids:
                    _tokens(out, now, last, len(r.token_ids))
                    last = now
                if r.finish_reason:
                    out.output_tokens = r.usage.completion_tokens
                    out.cached_tokens = r.usage.cached_prompt_tokens
            out.success = True
        except grpc.aio.AioRpcError as exc:
            out.error = f"{exc.code().name}: {exc.details()}"
        out.latency = time.perf_counter() - out.start
        return out

    async def close(self) -> None:
        await self._channel.close()


class ModelListError(RuntimeError):
    """The OpenAI API did not say which model it serves (and ``--model`` did not either)."""


class OpenAIBackend:
    """``POST api_url`` (a completions API, ``.../v1/completions``) streamed, with
    ``stream_options.include_usage``: the usage chunk gives the exact output token count;
    each text chunk counts as one token message (the server sends one per step), the last
    one taking any remainder. ``models_url`` (``.../v1/models``) names the model when
    ``model`` is None."""

    def __init__(
        self, api_url: str, models_url: str, model: str | None, api_key: str | None
    ) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(None, connect=30),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.api_url = api_url
        self.models_url = models_url
        self.model = model

    async def resolve_model(self) -> str:
        """The model to ask for: ``model``, else the first one ``models_url`` lists; raises
        :class:`ModelListError` naming the URL and the server's answer."""
        if self.model is None:
            try:
                r = await self._client.get(self.models_url)
                r.raise_for_status()
                self.model = str(r.json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise ModelListError(f"cannot list the models at {self.models_url}: {exc}") from exc
        return self.model

    async def send(self, req: BenchRequest, ignore_eos: bool) -> RequestOutput:
        out = RequestOutput(req.prompt_len, start=time.perf_counter())
        body = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "temperature": 0,
            "ignore_eos": ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        last = out.start
        chunks = 0
        try:
            async with self._client.stream("POST", self.api_url, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                    out.latency = time.perf_counter() - out.start
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"].get("message", "error"))
                    now = time.perf_counter()
                    if usage := chunk.get("usage"):
                        out.output_tokens = usage["completion_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        out.cached_tokens = int(details.get("cached_tokens") or 0)
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        _tokens(out, now, last, 1)
                        last, chunks = now, chunks + 1
            if out.token_times and out.output_tokens > chunks:
                t, n = out.token_times[-1]
                out.token_times[-1] = (t, n + out.output_tokens - chunks)
            out.success = True
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        out.latency = time.perf_counter() - out.start
        return out

    async def close(self) -> None:
        await self._client.aclose()


def _tokens(out: RequestOutput, now: float, last: float, n: int) -> None:
    if not out.token_times:
        out.ttft = now - out.start
    else:
        out.itl.append(now - last)
    out.token_times.append((now, n))
