"""End to end through the public API: real gateway, executor and block manager processes."""

from __future__ import annotations

import itertools
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving, wait_until
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

G = generation_pb2
STOP, LENGTH, ABORT = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORT,
)


def collect(stream) -> dict[int, dict]:
    """Per index: tokens, text, number of final messages, the final message."""
    out: dict[int, dict] = {}
    for resp in stream:
        s = out.setdefault(resp.index, {"tokens": [], "text": "", "finals": 0, "final": None})
        s["tokens"] += list(resp.token_ids)
        s["text"] += resp.text
        if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            s["finals"] += 1
            s["final"] = resp
    return out


def greedy(max_tokens: int, **kw) -> G.SamplingParams:
    return G.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_greedy_generate_matches_transformers(stack, tokenizer, hf_greedy):
    prompt = "A good cup of tea needs only three things"
    out = collect(
        stack.stub().Generate(G.GenerateRequest(prompt=prompt, sampling_params=greedy(24)))
    )
    ids = tokenizer(prompt).input_ids
    expected = hf_greedy(ids, 24)
    s = out[0]
    assert s["tokens"] == expected
    assert s["finals"] == 1
    final = s["final"]
    assert final.usage.prompt_tokens == len(ids)
    assert final.usage.completion_tokens == len(expected)
    eos = expected[-1] == 2
    assert final.finish_reason == (STOP if eos else LENGTH)
    assert s["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_64_concurrent_streams_all_finish_with_reasons_and_usage(stack):
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            req = G.GenerateRequest(
                prompt=f"Request number {i} says",
                request_id=f"c{i}",
                sampling_params=G.SamplingParams(
                    max_tokens=4 + i % 13, temperature=0.8, seed=i, ignore_eos=True
                ),
            )
            results[i] = collect(stack.stub().Generate(req, timeout=120))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, out in results.items():
        s = out[0]
        assert s["finals"] == 1 and s["final"].finish_reason == LENGTH
        assert s["final"].request_id == f"c{i}"
        assert len(s["tokens"]) == s["final"].usage.completion_tokens == 4 + i % 13
    assert stack.wait_blocks_free() == 0


def test_n_samples_each_end_with_exactly_one_final_message(stack):
    req = G.GenerateRequest(
        prompt="Once upon a time",
        sampling_params=G.SamplingParams(
            n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True
        ),
    )
    out = collect(stack.stub().Generate(req))
    assert sorted(out) == [0, 1, 2]
    for s in out.values():
        assert s["finals"] == 1 and len(s["tokens"]) == 10
    assert len({tuple(s["tokens"]) for s in out.values()}) > 1  # different samples


def test_stop_string_split_across_tokens_is_trimmed_and_stops(stack, tokenizer):
    base = collect(
        stack.stub().Generate(
            G.GenerateRequest(prompt="The server", sampling_params=greedy(30, ignore_eos=True))
        )
    )[0]
    tokens = base["tokens"]
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = [tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    k = next(
        i
        for i in range(5, len(tokens) - 2)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) > len(pieces[i])
    )
    stop = pieces[k + 1][len(pieces[k]) - 1 : len(pieces[k]) + 1]
    start = base["text"].index(stop)
    for include in (False, True):
        out = collect(
            stack.stub().Generate(
                G.GenerateRequest(
                    prompt="The server",
                    sampling_params=greedy(
                        30,
                        ignore_eos=True,
                        stop=[stop, "zzzz-never"],
                        include_stop_str_in_output=include,
                    ),
                )
            )
        )[0]
        expected = base["text"][: start + (len(stop) if include else 0)]
        assert out["text"] == expected
        assert out["final"].finish_reason == STOP and out["final"].stop_string == stop
        assert out["finals"] == 1
        assert len(out["tokens"]) < 30
    assert stack.wait_blocks_free() == 0  # the executor was told to stop at once


def test_streamed_text_never_splits_a_utf8_character(stack, tokenizer):
    seen_non_ascii = False
    for seed in range(6):
        params = G.SamplingParams(max_tokens=48, temperature=1.2, seed=seed, ignore_eos=True)
        req = G.GenerateRequest(prompt="Café crème, 日本語 and 🙂", sampling_params=params)
        texts, tokens = [], []
        for resp in stack.stub().Generate(req):
            texts.append(resp.text)
            tokens += resp.token_ids
        # A random model may emit bytes that are invalid UTF-8 in the full decode too; what must
        # never happen is a replacement character for a character that later completes, which
        # would make the streamed text differ from the decode of all tokens.
        assert "".join(texts) == tokenizer.decode(tokens, skip_special_tokens=True)
        seen_non_ascii |= any(ord(c) > 127 for c in "".join(texts))
    assert seen_non_ascii  # the seeds above produce multi-byte output


def test_chat_messages_use_the_chat_template(stack, tokenizer):
    messages = [
        G.ChatMessage(role="system", content="Be brief."),
        G.ChatMessage(role="user", content="Hello there"),
    ]
    expected_ids = tokenizer(
        tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    ).input_ids
    tok = stack.stub().Tokenize(G.TokenizeRequest(messages=G.ChatMessages(messages=messages)))
    assert list(tok.token_ids) == expected_ids
    out = collect(
        stack.stub().Generate(
            G.GenerateRequest(messages=G.ChatMessages(messages=messages), sampling_params=greedy(5))
        )
    )[0]
    assert out["final"].usage.prompt_tokens == len(expected_ids)


def test_logprobs_come_with_every_token(stack, tokenizer):
    req = G.GenerateRequest(prompt="Hello", sampling_params=greedy(6, logprobs=2, ignore_eos=True))
    n = 0
    for resp in stack.stub().Generate(req):
        assert len(resp.logprobs) == len(resp.token_ids)
        for tid, lp in zip(resp.token_ids, resp.logprobs, strict=True):
            n += 1
            assert lp.token_id == tid and lp.logprob <= 0
            assert len(lp.top_logprobs) == 2
            assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
            assert lp.token_id == lp.top_logprobs[0].token_id  # greedy picks the top one
            assert lp.token == tokenizer.convert_ids_to_tokens(tid)
    assert n == 6


def test_tokenize_detokenize_and_model_info(stack, tokenizer):
    stub = stack.stub()
    tok = stub.Tokenize(G.TokenizeRequest(text="Hello world"))
    assert list(tok.token_ids) == tokenizer("Hello world").input_ids
    assert len(tok.tokens) == len(tok.token_ids)
    text = stub.Detokenize(G.DetokenizeRequest(token_ids=tok.token_ids)).text
    assert text == "Hello world"
    info = stub.GetModelInfo(G.GetModelInfoRequest())
    assert info.model_name == "tiny-llama" and info.max_model_len == 512
    assert info.vocab_size == len(tokenizer) and info.block_size == 16
    assert info.kv_capacity_tokens == 255 * 16 and info.max_n == 4


BAD = [
    ("input", G.GenerateRequest(sampling_params=greedy(4))),
    ("prompt", G.GenerateRequest(prompt="", sampling_params=greedy(4))),
    ("prompt_token_ids", G.GenerateRequest(prompt_token_ids=G.TokenIds(ids=[]))),
    ("prompt_token_ids.ids[1]", G.GenerateRequest(prompt_token_ids=G.TokenIds(ids=[1, 99999]))),
    (
        "sampling_params.max_tokens",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(max_tokens=0)),
    ),
    (
        "sampling_params.max_tokens",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(max_tokens=600)),
    ),
    (
        "sampling_params.temperature",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(temperature=-0.5)),
    ),
    (
        "sampling_params.temperature",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(temperature=float("nan"))),
    ),
    (
        "sampling_params.top_p",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(top_p=0.0)),
    ),
    (
        "sampling_params.top_p",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(top_p=1.5)),
    ),
    (
        "sampling_params.top_k",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(top_k=-2)),
    ),
    ("sampling_params.n", G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(n=0))),
    ("sampling_params.n", G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(n=5))),
    (
        "sampling_params.stop[1]",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(stop=["ok", ""])),
    ),
    (
        "sampling_params.stop_token_ids[0]",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(stop_token_ids=[10**6])),
    ),
    (
        "sampling_params.repetition_penalty",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(repetition_penalty=0.0)),
    ),
    (
        "sampling_params.presence_penalty",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(presence_penalty=3.0)),
    ),
    (
        "sampling_params.frequency_penalty",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(frequency_penalty=-2.5)),
    ),
    (
        "sampling_params.min_tokens",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(max_tokens=2, min_tokens=3)),
    ),
    (
        "sampling_params.logit_bias[1000000]",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(logit_bias={10**6: 1.0})),
    ),
    (
        "sampling_params.logit_bias[7]",
        G.GenerateRequest(prompt="x", sampling_params=G.SamplingParams(logit_bias={7: -101.0})),
    ),
    (
        "messages.messages[0].role",
        G.GenerateRequest(
            messages=G.ChatMessages(messages=[G.ChatMessage(role="wizard", content="hi")])
        ),
    ),
    ("messages.messages", G.GenerateRequest(messages=G.ChatMessages())),
    ("request_id", G.GenerateRequest(request_id="x" * 300, prompt="x")),
]


@pytest.mark.parametrize(("field", "request_"), BAD, ids=[f for f, _ in BAD])
def test_invalid_requests_are_invalid_argument_naming_the_field(stack, field, request_):
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub().Generate(request_, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()


def test_prompt_plus_max_tokens_over_max_model_len_is_refused(stack):
    req = G.GenerateRequest(
        prompt_token_ids=G.TokenIds(ids=[1] * 500), sampling_params=G.SamplingParams(max_tokens=20)
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub().Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len=512" in info.value.details()


def test_cancel_mid_stream_frees_the_blocks(stack):
    req = G.GenerateRequest(
        prompt="Tell me everything",
        sampling_params=G.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
    )
    call = stack.stub().Generate(req)
    got = 0
    for resp in call:
        got += len(resp.token_ids)
        if got >= 3:
            assert stack.blocks_in_use() > 0
            call.cancel()
            break
    assert stack.wait_blocks_free() == 0


def test_deadline_expiry_is_deadline_exceeded_and_frees_the_blocks(stack):
    req = G.GenerateRequest(
        prompt="Tell me everything",
        sampling_params=G.SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True),
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub().Generate(req, timeout=0.2))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stack.wait_blocks_free() == 0


def test_api_key_is_required_when_configured(stack):
    gw = stack.start_gateway("--api-key", "s3cret")
    try:
        stub = stack.stub(gw.address)
        req = G.GenerateRequest(prompt="hi", sampling_params=greedy(2))
        for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, metadata=metadata, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelInfo(G.GetModelInfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wait_serving(gw.address)  # health stays open
        out = collect(stub.Generate(req, metadata=[("authorization", "Bearer s3cret")]))
        assert out[0]["finals"] == 1
        # Garbage bytes: refused for the missing key before they are parsed, INVALID_ARGUMENT
        # (not UNKNOWN) with the key.
        with grpc.insecure_channel(gw.address) as channel:
            raw = channel.unary_stream("/pagedserve.v1.Generation/Generate")
            for metadata, code in (
                (None, grpc.StatusCode.UNAUTHENTICATED),
                ([("authorization", "Bearer s3cret")], grpc.StatusCode.INVALID_ARGUMENT),
            ):
                for body in (b"\xff\xff\xff not protobuf", b"\x0a\x02\xff\xfe"):  # bad UTF-8
                    with pytest.raises(grpc.RpcError) as info:
                        list(raw(body, metadata=metadata, timeout=10))
                    assert info.value.code() == code, info.value.details()
    finally:
        assert gw.stop() == 0


def test_admission_limit_refuses_at_once_beyond_max_concurrent_requests(stack):
    gw = stack.start_gateway("--max-concurrent-requests", "2", "--max-queued-requests", "0")
    try:
        wait_serving(gw.address)
        stub = stack.stub(gw.address)
        long = G.GenerateRequest(
            prompt="go on",
            sampling_params=G.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        )
        calls = [stub.Generate(long) for _ in range(2)]
        for call in calls:
            next(iter(call))  # both streams are running
        short = G.GenerateRequest(prompt="x", sampling_params=greedy(2))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(short, timeout=60))
        # Refused at once: queued, it would have run once a long stream ended (OK) or met its
        # deadline (DEADLINE_EXCEEDED), never RESOURCE_EXHAUSTED.
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_requests=0" in info.value.details()
        for call in calls:
            call.cancel()

        def admitted() -> dict | None:
            """The short request's samples, once the cancelled streams have left."""
            try:
                return collect(stub.Generate(short, timeout=60))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return None

        assert wait_until(admitted, what="a request admitted again")[0]["finals"] == 1
    finally:
        assert gw.stop() == 0


def test_health_not_serving_until_an_executor_is_ready(stack, tiny_model_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = ServiceProcess(
        gateway_args(tiny_model_dir, f"127.0.0.1:{port}"),
        "gateway_listening",
    )
    executor = None
    try:
        with grpc.insecure_channel(gw.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                list(
                    generation_pb2_grpc.GenerationStub(ch).Generate(
                        G.GenerateRequest(prompt="x"), timeout=5
                    )
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            executor = ServiceProcess(
                [
                    "executor",
                    "--model",
                    str(tiny_model_dir),
                    "--port",
                    str(port),
                    "--num-kv-blocks",
                    "64",
                    "--max-model-len",
                    "256",
                ],
                "executor_ready",
            )
            wait_serving(gw.address)
    finally:
        assert gw.stop() == 0
        if executor is not None:
            executor.stop()


def test_metrics_endpoint_exposes_latency_histograms_and_counters(stack):
    collect(stack.stub().Generate(G.GenerateRequest(prompt="metrics", sampling_params=greedy(8))))
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    for name in (
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_inter_token_latency_seconds_bucket",
        "pagedserve_e2e_request_latency_seconds_count",
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_usage_ratio",
        "pagedserve_prefix_cache_hit_ratio",
        "pagedserve_num_preemptions_total",
        "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total",
        'pagedserve_kv_tier_blocks_moved_total{move="offload"}',
        "pagedserve_kv_tier_failed_moves_total",
    ):
        assert name in body, name
    gen = next(
        line for line in body.splitlines() if line.startswith("pagedserve_generation_tokens_total")
    )
    assert float(gen.split()[-1]) > 0
    ahead = next(
        line
        for line in body.splitlines()
        if line.startswith("pagedserve_executor_steps_scheduled_ahead_total")
    )
    assert float(ahead.split()[-1]) > 0  # the stack's executor runs --async-scheduling

    # Once the engine is idle its last load reaches the gateway: no block shows as in use.
    def usage() -> float:
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=30)
            .read()
            .decode()
        )
        line = next(
            line for line in body.splitlines() if line.startswith("pagedserve_kv_cache_usage_ratio")
        )
        return float(line.split()[-1])

    wait_until(lambda: usage() == 0.0, what="pagedserve_kv_cache_usage_ratio back to 0")


def test_tls_serves_encrypted_clients_only(stack, tmp_path):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    gw = stack.start_gateway("--tls-cert", str(cert), "--tls-key", str(key))
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"localhost:{gw.port}", creds) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            deadline = time.monotonic() + 30
            while True:  # the new gateway connects to the executor first
                try:
                    out = collect(
                        stub.Generate(
                            G.GenerateRequest(prompt="secure", sampling_params=greedy(3)),
                            timeout=10,
                        )
                    )
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            assert out[0]["finals"] == 1
        with pytest.raises(grpc.RpcError) as info:
            stack.stub(gw.address).GetModelInfo(G.GetModelInfoRequest(), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # plaintext is refused
    finally:
        assert gw.stop() == 0


def test_huge_prompts_are_refused_without_stalling_other_streams(stack):
    """Prompts over --max-prompt-bytes are refused before tokenizing; the ones under it are
    tokenized off the event loop: a running stream keeps receiving tokens meanwhile."""
    gw = stack.start_gateway("--max-prompt-bytes", "4000000")
    try:
        wait_serving(gw.address)
        stub = stack.stub(gw.address)
        arrivals: list[float] = []
        background = G.GenerateRequest(
            prompt="Tell me a story", sampling_params=greedy(150, ignore_eos=True)
        )

        def stream() -> None:
            for _ in stub.Generate(background, timeout=60):
                arrivals.append(time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: len(arrivals) >= 5, what="the stream flowing")
        huge = "lorem ipsum dolor " * 215_000  # 3.9 MB: tokenized (in a thread), then too long
        refused = G.GenerateRequest(prompt=huge, sampling_params=greedy(2))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:  # (seconds; 40 s on a loaded 2-core machine)
            list(stub.Generate(refused, timeout=300))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_model_len" in info.value.details()
        t1 = time.monotonic()
        # On the stack's gateway (default limit: 32 bytes x max_model_len) it is refused at once.
        with pytest.raises(grpc.RpcError) as info:
            list(stack.stub().Generate(G.GenerateRequest(prompt=huge), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-prompt-bytes=16384" in info.value.details()
        t.join()
        during = [b - a for a, b in itertools.pairwise(arrivals) if t0 <= b <= t1]
        window = t1 - t0
        assert window > 0.3 and len(during) >= 3, (window, len(during))  # it did take a while
        # Tokenized on the event loop, the stream would stop for about the whole tokenization;
        # off it, the stream's gaps stay token gaps (~3 ms; 0.15 s at most on a loaded machine).
        stall = max(during)
        assert stall < window / 4, f"a stream stalled {stall:.3f} s of {window:.3f} s tokenizing"
    finally:
        assert gw.stop() == 0


def test_sigterm_drains_running_streams_and_refuses_new_ones(stack):
    gw = stack.start_gateway("--drain-timeout-s", "20")
    wait_serving(gw.address)
    stub = stack.stub(gw.address)
    got: list[G.GenerateResponse] = []
    errors: list[grpc.RpcError] = []
    request = G.GenerateRequest(prompt="Drain me", sampling_params=greedy(80, ignore_eos=True))

    def stream() -> None:
        try:
            for r in stub.Generate(request, timeout=60):
                got.append(r)
        except grpc.RpcError as exc:
            errors.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(got) >= 3 or errors, what="the stream flowing")
    gw.proc.send_signal(signal.SIGTERM)
    gw.wait_for_event("gateway_draining", timeout=60)  # logged as the server stops accepting
    with pytest.raises(grpc.RpcError) as info:  # draining: nothing new is accepted
        list(stub.Generate(G.GenerateRequest(prompt="late", sampling_params=greedy(2)), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    t.join(60)
    assert not errors, errors
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in got) == 80  # the running stream finished whole
    assert gw.proc.wait(30) == 0
    assert "gateway_draining" in gw.events()


def test_embed_on_generating_executors_is_invalid_argument_naming_the_runner(stack):
    request = G.EmbedRequest(text="hello")
    with pytest.raises(grpc.RpcError) as err:
        stack.stub().Embed(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(
        "model: this model is served by --runner generate executors; an embedding needs "
        "--runner pooling"
    )
