"""``/v1/completions`` prompts as OpenAI takes them: one string or token-id list, or a batch
of either, translated into one GenerateRequest per prompt; bad shapes name the prompt."""

from __future__ import annotations

import pytest

from services.common.limits import FieldError
from services.gateway.api.openai.protocol import MAX_PROMPTS_PER_REQUEST, CompletionRequest


def _requests(prompt, **kw):
    return CompletionRequest(model="m", prompt=prompt, **kw).to_generates()


def test_one_prompt_is_one_request_whatever_its_form() -> None:
    (text,) = _requests("Hello")
    (ids,) = _requests([1, 2, 3])
    (batch_of_one,) = _requests(["Hello"])
    assert text.prompt == batch_of_one.prompt == "Hello"
    assert list(ids.prompt_token_ids.ids) == [1, 2, 3]


def test_a_batch_is_one_request_per_prompt_with_the_same_sampling() -> None:
    reqs = _requests([[1, 2], [1, 3, 4]], max_tokens=5, n=2, seed=7, request_id="abc")
    assert [list(r.prompt_token_ids.ids) for r in reqs] == [[1, 2], [1, 3, 4]]
    assert all(r.sampling_params.max_tokens == 5 and r.sampling_params.n == 2 for r in reqs)
    assert [r.request_id for r in reqs] == ["abc-0", "abc-1"]  # distinct ids
    texts = _requests(["a", "b", "c"])
    assert [r.prompt for r in texts] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ([], "prompt"),
        (["x"] * (MAX_PROMPTS_PER_REQUEST + 1), "prompt"),
        ([[1, 2], []], "prompt[1]"),
        (["a", ""], "prompt[1]"),
    ],
)
def test_bad_prompts_are_refused_naming_which(prompt, field) -> None:
    with pytest.raises(FieldError) as info:
        _requests(prompt)
    assert info.value.field.startswith(field)
