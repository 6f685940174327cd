"""``pagedserve generate`` / ``chat`` against a stand-in gateway: one sample streams as it
comes; with ``-n`` > 1 each sample is printed whole (their chunks interleave on the wire)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services import client_cli

LENGTH = common_pb2.FINISH_REASON_LENGTH
# Two samples, interleaved as the gateway streams them; sample 1 finishes first.
CHUNKS = [(0, "Hello", 0), (1, "Good", 0), (0, ",", 0), (1, "bye", LENGTH), (0, " world", LENGTH)]


class _Gateway(generation_pb2_grpc.GenerationServicer):
    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after

    def Generate(self, request, context) -> Iterator[generation_pb2.GenerateResponse]:
        n = max(1, request.sampling_params.n)
        for sent, (index, text, finish) in enumerate(c for c in CHUNKS if c[0] < n):
            if sent == self.fail_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "executor lost")
            usage = common_pb2.Usage(prompt_tokens=2, completion_tokens=3) if finish else None
            yield generation_pb2.GenerateResponse(
                index=index, text=text, finish_reason=finish, usage=usage
            )


@pytest.fixture
def gateway(request) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(
        _Gateway(getattr(request, "param", None)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_generate_prints_each_of_n_samples_whole_on_its_line(gateway, capsys) -> None:
    code = client_cli.generate_main(["Hi", "-n", "2", "--usage", "--address", gateway])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == "[1] Goodbye\n[0] Hello, world\n"  # in the order they finish
    assert err.splitlines() == [
        "[1] FINISH_REASON_LENGTH prompt=2 completion=3 cached=0",
        "[0] FINISH_REASON_LENGTH prompt=2 completion=3 cached=0",
    ]


def test_generate_streams_one_sample_as_it_comes(gateway, capsys) -> None:
    assert client_cli.generate_main(["Hi", "--address", gateway]) == 0
    assert capsys.readouterr().out == "Hello, world\n"


@pytest.mark.parametrize("gateway", [4], indirect=True)  # fails before sample 0's last chunk
def test_generate_prints_what_the_samples_had_when_the_stream_fails(gateway, capsys) -> None:
    assert client_cli.generate_main(["Hi", "-n", "2", "--address", gateway]) == 1
    out, err = capsys.readouterr()
    assert out == "[1] Goodbye\n[0] Hello,\n"  # 1 had finished; 0 had "Hello," when it broke
    assert "error: UNAVAILABLE: executor lost" in err
