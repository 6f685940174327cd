"""What the gateway sends to carry a request on after its executor was lost: the original
request again while nothing was sent, else one ``n = 1`` request per unfinished sample with
the tokens it sent (finished samples stay finished; prompt log-probs are not asked twice)."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.v1 import executor_pb2
from services.gateway.core.resume import resume_adds


def _original(n: int) -> executor_pb2.AddRequest:
    return executor_pb2.AddRequest(
        request_id="first",
        prompt_token_ids=[1, 5, 9],
        sampling_params=executor_pb2.ExecutorSamplingParams(
            n=n, temperature=0.8, seed=3, max_tokens=20, min_tokens=4, prompt_logprobs=2
        ),
        priority=2,
        cache_salt=b"tenant",
    )


def _sample(index: int, tokens: list[int], done: bool = False) -> SimpleNamespace:
    return SimpleNamespace(index=index, token_ids=tokens, done=done)


def test_a_request_that_sent_nothing_is_sent_again_whole_under_a_new_id():
    original = _original(3)
    [(add, indexes)] = resume_adds(original, [_sample(i, []) for i in range(3)])
    assert indexes == [0, 1, 2]
    assert add.request_id != original.request_id
    assert not add.HasField("resume")
    add.request_id = original.request_id
    assert add == original  # prompt log-probs included: none were sent


def test_each_unfinished_sample_carries_on_alone_from_the_tokens_it_sent():
    original = _original(3)
    samples = [_sample(0, [7, 8, 9]), _sample(1, [4], done=True), _sample(2, [6, 6])]
    adds = resume_adds(original, samples)
    assert [indexes for _, indexes in adds] == [[0], [2]]
    assert len({add.request_id for add, _ in adds} | {original.request_id}) == 3
    for (add, [index]), tokens in zip(adds, ([7, 8, 9], [6, 6]), strict=True):
        assert add.HasField("resume")
        assert add.resume.sample_index == index
        assert list(add.resume.output_token_ids) == tokens
        assert list(add.prompt_token_ids) == [1, 5, 9]
        p = add.sampling_params
        assert (p.n, p.max_tokens, p.min_tokens, p.seed) == (1, 20, 4, 3)
        assert not p.HasField("prompt_logprobs")  # sent with sample 0's first token
        assert (add.priority, add.cache_salt) == (2, b"tenant")


def test_sample_0_without_tokens_still_asks_for_its_prompt_logprobs():
    adds = resume_adds(_original(2), [_sample(0, []), _sample(1, [3])])
    by_index = {indexes[0]: add for add, indexes in adds}
    assert by_index[0].HasField("resume") and not by_index[0].resume.output_token_ids
    assert by_index[0].sampling_params.HasField("prompt_logprobs")
    assert not by_index[1].sampling_params.HasField("prompt_logprobs")
