"""The OpenAI-compatible HTTP API of the real gateway process, driven by the official
``openai`` client (and ``httpx`` for the raw Server-Sent-Events bytes): completions and chat,
streaming and not, n, stop strings, logprobs, seeds, usage, errors and their statuses, and
greedy parity with the gRPC API."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from pagedserve.v1 import generation_pb2 as G
from tests.gateway.conftest import Stack

PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
]


def base_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=base_url(stack.http_port), api_key="unused", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def grpc_greedy_text(stack: Stack, request: G.GenerateRequest) -> str:
    return "".join(r.text for r in stack.stub().Generate(request, timeout=60))


# ---- completions --------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, stack: Stack) -> None:
    (card,) = client.models.list().data
    assert card.id == stack.model_dir.name and card.object == "model"


def test_greedy_completion_text_equals_the_grpc_api(client, model, stack) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = grpc_greedy_text(
        stack,
        G.GenerateRequest(
            prompt=PROMPT,
            sampling_params=G.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        ),
    )
    (choice,) = out.choices
    assert choice.text == expected and choice.finish_reason == "length"
    assert out.object == "text_completion" and out.model == model
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_logit_bias_reaches_the_sampler_as_through_the_grpc_api(client, model, stack) -> None:
    """OpenAI's logit_bias (token ids as strings): +100 on one token makes it every output
    token; a mixed bias gives the gRPC API's tokens for the same bias."""
    forced = [
        t
        for r in stack.stub().Generate(
            G.GenerateRequest(
                prompt=PROMPT,
                sampling_params=G.SamplingParams(
                    max_tokens=6, temperature=0, ignore_eos=True, logit_bias={300: 100.0}
                ),
            ),
            timeout=60,
        )
        for t in r.token_ids
    ]
    assert forced == [300] * 6
    bias = {300: 4.0, 301: -2.5, 302: 6.0}
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    expected = grpc_greedy_text(
        stack,
        G.GenerateRequest(
            prompt=PROMPT,
            sampling_params=G.SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True, logit_bias=bias
            ),
        ),
    )
    unbiased = grpc_greedy_text(
        stack,
        G.GenerateRequest(
            prompt=PROMPT,
            sampling_params=G.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        ),
    )
    assert out.choices[0].text == expected != unbiased


def _greedy_grpc(stack: Stack, prompt: str | list[int], n: int = 1) -> str:
    request = G.GenerateRequest(
        sampling_params=G.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=n)
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    return grpc_greedy_text(stack, request) if n == 1 else ""


def test_several_prompts_in_one_completion_get_choices_in_prompt_order(
    client, model, stack
) -> None:
    """A batch of prompts (strings, or token-id lists: lm-evaluation-harness's
    ``--batch_size``): prompt i's choices are indexes i*n .. i*n+n-1, each as that prompt
    alone would get, and the usage counts every prompt once."""
    prompts = ["The train", PROMPT, "How does a server answer"]
    out = client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        expected = _greedy_grpc(stack, prompt)
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == expected
    singles = [
        client.completions.create(model=model, prompt=p, max_tokens=1, temperature=0)
        for p in prompts
    ]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == 6 * 8
    ids = [[1, 45, 46, 47], [1, 60, 61]]
    by_ids = client.completions.create(
        model=model, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in by_ids.choices] == [_greedy_grpc(stack, p) for p in ids]


def test_one_prompt_with_n_choices_counts_its_prompt_once_and_echoes_it_in_each(
    client, model
) -> None:
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    two = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, n=2, echo=True, logprobs=0
    )
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    for choice in two.choices:
        assert choice.text.startswith(PROMPT)
        assert choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.token_logprobs) == one.usage.prompt_tokens + 3


def test_several_prompts_stream_their_choices_interleaved(client, model) -> None:
    prompts = ["The train", PROMPT]
    whole = client.completions.create(
        model=model, prompt=prompts, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
        if not chunk.choices:
            assert chunk.usage.total_tokens == whole.usage.total_tokens
    assert finished == {0, 1}
    assert [texts[i] for i in (0, 1)] == [c.text for c in whole.choices]


def test_a_bad_prompt_in_a_batch_is_400_naming_it_and_runs_none(client, model, stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[[1, 5], [1, 10**6]], max_tokens=4)
    assert info.value.body["param"] == "prompt[1][1]", info.value.body
    assert stack.wait_blocks_free(timeout=10) == 0


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_harness_reads_it(
    client, model, stack, tiny_model_dir
) -> None:
    """lm-evaluation-harness's log-likelihood request: the prompt as token ids, ``echo``,
    ``logprobs=1``, ``max_tokens=1``. Every prompt token but the first gets transformers'
    log-probability given the tokens before it; the first gets None."""
    ids = [1, 45, 46, 47, 48, 49, 50]
    out = client.completions.create(
        model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4, p
    assert out.choices[0].text.startswith(stack_decode(tiny_model_dir, ids))
    # The gRPC API gives the same numbers (its prompt_logprobs start at token 1).
    request = G.GenerateRequest(
        sampling_params=G.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    )
    request.prompt_token_ids.ids.extend(ids)
    first = next(iter(stack.stub().Generate(request, timeout=60)))
    assert [x.token_id for x in first.prompt_logprobs] == ids[1:]
    assert all(len(x.top_logprobs) == 2 and x.token for x in first.prompt_logprobs)
    got = [x.logprob for x in first.prompt_logprobs]
    assert max(abs(a - b) for a, b in zip(got, lp.token_logprobs[1:-1], strict=True)) < 1e-6


def stack_decode(model_dir, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client, model) -> None:
    """vLLM's (and lm-evaluation-harness's) ``max_tokens: 0`` with ``echo``: the prompt's
    text and log-probabilities, no completion, no completion tokens in the usage."""
    ids = [1, 45, 46, 47, 48, 49, 50]
    kw = dict(model=model, prompt=ids, temperature=0, logprobs=2, echo=True)
    alone = client.completions.create(**kw, max_tokens=0)
    one = client.completions.create(**kw, max_tokens=1)
    a, b = alone.choices[0], one.choices[0]
    assert a.logprobs.token_logprobs == b.logprobs.token_logprobs[: len(ids)]
    assert a.logprobs.tokens == b.logprobs.tokens[: len(ids)]
    assert b.text.startswith(a.text) and len(a.logprobs.tokens) == len(ids)
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=ids, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_echo_without_logprobs_prefixes_the_prompt_and_echo_does_not_stream(client, model) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith(PROMPT)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, echo=True, stream=True)
    assert info.value.body["param"] == "echo"


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(client, model) -> None:
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.finish_reason and not any(finishes[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completions_send_no_empty_text_for_tokens_ending_mid_character(
    client, model, stack
) -> None:
    # The tiny model's greedy output here has byte tokens ending inside a UTF-8 character:
    # the gRPC API streams those as messages with token ids and no text yet.
    n = 24
    grpc = stack.stub().Generate(
        G.GenerateRequest(
            prompt=PROMPT,
            sampling_params=G.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        ),
        timeout=60,
    )
    assert any(r.token_ids and not r.text and not r.finish_reason for r in grpc)
    kw = dict(model=model, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0)
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert all(c.text or c.finish_reason for c in chunks), [c.text for c in chunks]
    assert "".join(c.text for c in chunks) == whole.text
    # The held tokens' logprobs come with the text that completes them: none is lost.
    streamed = [t for c in chunks for t in c.logprobs.tokens]
    assert streamed == whole.logprobs.tokens and len(streamed) == n


def _usage_stream(client, model: str, kind: str, stream_options: dict) -> list:
    kw = dict(
        model=model,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options=stream_options,
        extra_body={"ignore_eos": True},
    )
    if kind == "completions":
        return list(client.completions.create(prompt=PROMPT, logprobs=0, **kw))
    return list(client.chat.completions.create(messages=MESSAGES, logprobs=True, **kw))


def _tokens_in(chunk, kind: str) -> int:
    if not chunk.choices or chunk.choices[0].logprobs is None:
        return 0
    lp = chunk.choices[0].logprobs
    return len(lp.tokens if kind == "completions" else lp.content or [])


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model, kind) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _usage_stream(client, model, kind, options)
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    assert prompt > 0 and not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8
    so_far = 0
    for c in chunks[:-1]:
        so_far += _tokens_in(c, kind)
        assert c.usage.prompt_tokens == prompt
        assert c.usage.completion_tokens == so_far  # each token's logprob counted once
        assert c.usage.total_tokens == prompt + so_far
    assert so_far == 8
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].usage.completion_tokens == 0


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_need_include_usage_as_in_vllm(client, model, kind) -> None:
    chunks = _usage_stream(client, model, kind, {"continuous_usage_stats": True})
    assert chunks and all(c.usage is None for c in chunks)


def test_prompt_as_token_ids_matches_the_text_prompt(client, model, stack) -> None:
    ids = list(stack.stub().Tokenize(G.TokenizeRequest(text=PROMPT)).token_ids)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_n_samples_are_indexed_and_seeds_reproduce(client, model) -> None:
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    streamed = client.completions.create(**kw, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in a.choices]


def test_stop_strings_cut_the_text(client, model) -> None:
    full = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    stop = full.text.strip()[2:5]
    assert stop
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_completion_logprobs_have_one_entry_per_token(client, model) -> None:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Greedy: the chosen token is the most likely one.
    assert all(lp.token_logprobs[i] >= max(lp.top_logprobs[i].values()) - 1e-5 for i in range(6))


# ---- chat ---------------------------------------------------------------------------------


def test_greedy_chat_equals_the_grpc_api_with_messages(client, model, stack) -> None:
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0
    )
    expected = grpc_greedy_text(
        stack,
        G.GenerateRequest(
            messages=G.ChatMessages(messages=[G.ChatMessage(**m) for m in MESSAGES]),
            sampling_params=G.SamplingParams(max_tokens=10, temperature=0),
        ),
    )
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert out.object == "chat.completion"


def test_streamed_chat_sends_the_role_first_then_content_then_the_finish(client, model) -> None:
    kw = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant" and not deltas[0].delta.content
    assert "".join(d.delta.content or "" for d in deltas) == whole.message.content
    assert deltas[-1].finish_reason == whole.finish_reason
    assert not any(d.finish_reason for d in deltas[:-1])
    usage = chunks[-1].usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens >= 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_without_max_tokens_may_fill_the_context(client, model) -> None:
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 512  # --max-model-len


def test_chat_logprobs_with_top_alternatives(client, model) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(t.bytes == list(t.token.encode()) for t in content)


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"n": -1}, "n"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias[5]"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias[x]"),
        ({"logit_bias": {"99999999": 1.0}}, "logit_bias[99999999]"),
        ({"logit_bias": {"²": 1.0}}, "logit_bias[²]"),  # a digit to str.isdigit, not to int
        ({"logit_bias": {"5": 1.0, "05": 2.0}}, "logit_bias[05]"),  # one token twice
        ({"extra_body": {"min_p": 2.0}}, "min_p"),
    ],
)
def test_invalid_fields_are_400_naming_the_param(client, model, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    assert info.value.status_code == 400
    body = info.value.body
    assert body["param"] == param, body
    assert body["type"] == "invalid_request_error" and param in body["message"]


def test_a_history_tool_call_without_a_function_name_is_400_naming_it(client, model) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert info.value.body["param"] == "messages[1].tool_calls[0].function"


def test_a_missing_required_field_is_400_not_422(stack) -> None:
    r = httpx.post(f"{base_url(stack.http_port)}/completions", json={"model": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"


def test_an_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert info.value.body["code"] == "model_not_found"


def test_the_api_key_is_required_when_set(stack) -> None:
    gw = stack.start_gateway("--api-key", "sesame")
    try:
        wait_serving(gw.address)
        port = int(gw.wait_for_event("http_listening")["http_port"])
        wrong = openai.OpenAI(base_url=base_url(port), api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.status_code == 401
        right = openai.OpenAI(base_url=base_url(port), api_key="sesame", max_retries=0)
        out = right.completions.create(
            model=stack.model_dir.name, prompt=PROMPT, max_tokens=2, temperature=0
        )
        assert out.choices[0].text is not None
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # open
    finally:
        gw.stop()


def _gauge(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}")


def test_beyond_max_concurrent_requests_requests_queue_then_are_429_and_lose_nothing(
    stack: Stack,
) -> None:
    gw = stack.start_gateway("--max-concurrent-requests", "1", "--max-queued-requests", "1")
    try:
        wait_serving(gw.address)
        port = int(gw.wait_for_event("http_listening")["http_port"])
        c = openai.OpenAI(base_url=base_url(port), api_key="x", max_retries=0)
        model = stack.model_dir.name
        started = threading.Event()
        done: list[str] = []
        queued: list[str | None] = []

        def hold() -> None:  # about a second of decoding
            stream = c.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=500,
                n=4,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text = ""
            for chunk in stream:
                started.set()
                text += chunk.choices[0].text if chunk.choices else ""
            done.append(text)

        def wait_in_queue() -> None:
            out = c.completions.create(model=model, prompt=PROMPT, max_tokens=2)
            queued.append(out.choices[0].finish_reason)

        running = threading.Thread(target=hold)
        running.start()
        assert started.wait(30)
        waiting = threading.Thread(target=wait_in_queue)
        waiting.start()
        deadline = time.monotonic() + 10
        while _gauge(port, "pagedserve_gateway_requests_queued") < 1:
            assert time.monotonic() < deadline, "the second request did not queue"
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:  # both full: refused at once
            c.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 429
        message = info.value.body["message"]
        assert "max_concurrent_requests=1" in message and "max_queued_requests=1" in message
        # A batch of more prompts than the gateway admits at once could never run: 400.
        with pytest.raises(openai.BadRequestError) as bad:
            c.completions.create(model=model, prompt=["a", "b", "c"], max_tokens=2)
        assert bad.value.body["param"] == "prompt" and "(2:" in bad.value.body["message"]
        running.join(120)
        waiting.join(120)
        assert done and done[0]  # the admitted stream was not disturbed
        assert queued and queued[0] is not None  # the queued one ran once a slot was free
        assert _gauge(port, "pagedserve_gateway_requests_queued") == 0
    finally:
        gw.stop()


# ---- raw bytes, disconnects, the rest -------------------------------------------------------


def test_server_sent_events_bytes_are_what_openai_sends(stack: Stack, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url(stack.http_port)}/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event
        chunk = json.loads(event[len(b"data: ") :])
        assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")


def _cancelled(stack: Stack) -> float:
    for line in httpx.get(f"http://127.0.0.1:{stack.http_port}/metrics").text.splitlines():
        if line.startswith('pagedserve_requests_total{outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_disconnects_mid_stream_aborts_and_frees_its_blocks(
    stack: Stack, model: str
) -> None:
    before = _cancelled(stack)
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{base_url(stack.http_port)}/completions", json=body) as r:
        for _ in r.iter_lines():
            break  # one event, then hang up
    deadline = time.monotonic() + 10
    while _cancelled(stack) == before:  # counted as cancelled, not run to its end
        assert time.monotonic() < deadline, "the disconnect did not cancel the request"
        time.sleep(0.05)
    assert stack.wait_blocks_free(timeout=10) == 0


def test_tokenize_and_detokenize_match_the_grpc_api(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.http_port}"
    ids = list(stack.stub().Tokenize(G.TokenizeRequest(text=PROMPT)).token_ids)
    tok = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == ids and tok["count"] == len(ids) and tok["max_model_len"] == 512
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    grpc_chat = stack.stub().Tokenize(
        G.TokenizeRequest(messages=G.ChatMessages(messages=[G.ChatMessage(**m) for m in MESSAGES]))
    )
    assert chat["tokens"] == list(grpc_chat.token_ids)
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == stack.stub().Detokenize(G.DetokenizeRequest(token_ids=ids)).text
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids[0]"


def test_health_and_metrics_over_http(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.http_port}"
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert "pagedserve_requests_total" in metrics


def test_no_executor_serving_is_503(stack: Stack) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    gw = ServiceProcess(gateway_args(stack.model_dir, dead), "gateway_listening")
    try:
        port = int(gw.wait_for_event("http_listening")["http_port"])
        c = openai.OpenAI(base_url=base_url(port), api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=stack.model_dir.name, prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 503 and "retry" in info.value.body["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
    finally:
        gw.stop()


# ---- the front's own errors: every one in OpenAI's shape --------------------------------------


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"model": "m", "prompt": "x",,}', "line 1 column 30"),
        (b'{"model": "m",\n  "prompt": }', "line 2 column 13"),
        (b'{"model": "m", "prompt": "x"', "line 1 column 29"),
    ],
)
def test_a_malformed_json_body_is_400_saying_so_and_where(stack: Stack, raw, where) -> None:
    r = httpx.post(
        f"{base_url(stack.http_port)}/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    error = _error(r, 400)
    assert error["param"] is None and error["type"] == "invalid_request_error", error
    assert "not valid JSON" in error["message"] and where in error["message"], error


@pytest.mark.parametrize(
    ("raw", "words"),
    [(b"", "empty"), (b"[1, 2]", "JSON object"), (b'"text"', "JSON object")],
)
def test_a_body_that_is_no_json_object_is_400_saying_so(stack: Stack, raw, words) -> None:
    r = httpx.post(
        f"{base_url(stack.http_port)}/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    error = _error(r, 400)
    assert error["param"] is None and words in error["message"], error


def test_a_field_of_the_wrong_type_is_400_naming_it(stack: Stack, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": "many"}
    error = _error(httpx.post(f"{base_url(stack.http_port)}/completions", json=body), 400)
    assert error["param"] == "max_tokens" and "integer" in error["message"], error
    messages = [{"role": "user", "content": 5}]
    body = {"model": model, "messages": messages}
    error = _error(httpx.post(f"{base_url(stack.http_port)}/chat/completions", json=body), 400)
    assert error["param"].startswith("messages[0].content"), error


def test_unknown_routes_and_methods_answer_in_openais_error_shape(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.http_port}"
    error = _error(httpx.get(f"{url}/v1/nope"), 404)
    assert error["message"] == "Invalid URL (GET /v1/nope)" and error["param"] is None, error
    r = httpx.get(f"{base_url(stack.http_port)}/completions")
    error = _error(r, 405)
    assert "GET" in error["message"] and "POST" in error["message"], error
    assert r.headers["allow"] == "POST"


def test_models_retrieve_gives_the_served_model_and_404_for_another(client, model) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.owned_by == "pagedserve"
    assert card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found", info.value.body
    assert "no-such-model" in info.value.body["message"]


def test_unknown_fields_are_ignored_but_named_in_a_header_and_the_log(client, model, stack) -> None:
    """As vLLM: a field this server does not know is ignored (clients send other servers'
    extras), but not silently: the response names it (``x-pagedserve-ignored-fields``) and
    the gateway logs it."""
    raw = client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, temperature=0, extra_body={"max_token": 3, "top_z": 1}
    )
    assert raw.status_code == 200
    assert raw.headers["x-pagedserve-ignored-fields"] == "max_token, top_z"
    assert raw.parse().usage.completion_tokens == 16  # max_token is not max_tokens
    event = stack.gateway.wait_for_event("openai_fields_ignored")
    assert event["fields"] == ["max_token", "top_z"] and event["level"] == "warning"
    stream = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Hi", "nmae": "x"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "usage_everywhere": True},
    )
    assert stream.headers["x-pagedserve-ignored-fields"] == (
        "stream_options.usage_everywhere, messages[0].nmae"
    )
    assert list(stream.parse())
    plain = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=2)
    assert "x-pagedserve-ignored-fields" not in plain.headers
    with pytest.raises(openai.BadRequestError) as info:  # named on a refusal too
        client.completions.create(
            model=model, prompt=PROMPT, temperature=-1, extra_body={"max_token": 3}
        )
    assert info.value.response.headers["x-pagedserve-ignored-fields"] == "max_token"
