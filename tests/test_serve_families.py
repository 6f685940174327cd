"""Every model family through the whole stack (``pagedserve serve``: gateway, executor and
block manager processes): greedy tokens and beam-search beams identical to transformers,
with prefill chunked, a KV cache small enough to preempt, and a prefix-cache hit; and the
chat path renders the family's own template."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.testing.procs import ServeStack, wait_serving
from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.executor.greedy import hf_beams

G = generation_pb2
MAX_TOKENS = 10
PROMPTS = (
    "The train",
    "A good cup of tea needs only three things: fresh water, a warm pot",
    "How does a server answer many requests at once? It keeps a queue of work and a pool of "
    "workers, and each worker takes the next task.",
    "Café crème, 日本語 and 🙂 are all bytes",
)
# Windows of 16 tokens, crossed by the longer prompts.
FAMILIES: dict[str, dict[str, Any]] = {
    "mistral": {"arch": "mistral", "sliding_window": 16},
    "qwen2": {"arch": "qwen2", "sliding_window": 16},
    "qwen3": {"arch": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    "qwen3_moe": {"arch": "qwen3_moe"},
    "mixtral": {"arch": "mixtral", "sliding_window": 16},
    "phi4_mini": {"arch": "phi3", "rope_scaling": "longrope", "partial_rotary_factor": 0.75},
    "gemma2": {"arch": "gemma2"},
    "gemma3": {"arch": "gemma3", "head_dim": 32},
    # Tensor parallelism over 2 CPU ranks (gloo): heads, MLP and every expert's width cut.
    "qwen3_tp2": {"arch": "qwen3", "head_dim": 32, "num_heads": 4, "num_kv_heads": 2},
    "qwen3_moe_tp2": {"arch": "qwen3_moe"},
}
TENSOR_PARALLEL = {"qwen3_tp2": 2, "qwen3_moe_tp2": 2}
# Phi-4-mini's LongRoPE: served within its original context (64), the short factors, as
# transformers uses for these prompts.
MAX_MODEL_LEN = {"phi4_mini": 64}
# Hybrid KV caches (a sliding and a full group, a block of one layer each: Gemma's, and
# Qwen2's with use_sliding_window, full below max_window_layers): 19 blocks of half the size,
# so that one 88-token sequence fits (11 full + 6 sliding blocks) and the 4 prompts together
# do not.
NUM_KV_BLOCKS = {"gemma2": 20, "gemma3": 20, "qwen2": 20}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    name = request.param
    model = write_tiny_model(tmp_path_factory.mktemp(name), seed=40, **FAMILIES[name])
    executor_args = (
        # 88 tokens: 4 prompts preempt
        *("--num-kv-blocks", str(NUM_KV_BLOCKS.get(name, 12)), "--block-size", "8"),
        *("--max-model-len", str(MAX_MODEL_LEN.get(name, 88))),
        *("--max-num-batched-tokens", "16"),  # prompts prefilled in chunks
        *("--tensor-parallel-size", str(TENSOR_PARALLEL.get(name, 1))),
    )
    stack = ServeStack(model, executor_args=executor_args)
    try:
        wait_serving(stack.address, timeout=90)
        yield name, model, stack
    finally:
        stack.stop()


def _generate(stub: generation_pb2_grpc.GenerationStub, **request: Any) -> tuple[list[int], Any]:
    params = G.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    tokens: list[int] = []
    final = None
    for resp in stub.Generate(G.GenerateRequest(sampling_params=params, **request), timeout=120):
        tokens += resp.token_ids
        if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            final = resp
    return tokens, final


@torch.inference_mode()
def _hf_greedy(model: Any, ids: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
    )
    return out[0, len(ids) :].tolist()


def test_family_serves_transformers_greedy_tokens_through_the_stack(family) -> None:
    name, model_dir, stack = family
    if name in TENSOR_PARALLEL:  # the executor really runs its ranks
        assert any(r.get("event") == "tensor_parallel_started" for r in stack.lines), name
    if name in NUM_KV_BLOCKS:  # served from a hybrid pool: a sliding and a full group
        (groups,) = [r for r in stack.lines if r.get("event") == "kv_cache_groups"]
        assert sorted(groups["kinds"]) == ["full", "sliding"], groups
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            got[i] = _generate(stub, prompt=PROMPTS[i])[0]

        # All at once: together they outgrow the 11 usable blocks, so some are preempted.
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for i, prompt in enumerate(PROMPTS):
            assert got[i] == _hf_greedy(hf, tokenizer(prompt).input_ids), f"{name}: prompt {i}"

        # Two samples of one request (n > 1: forked sequences sharing the prompt's blocks),
        # both greedy: both are transformers' tokens.
        params = G.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2)
        samples: dict[int, list[int]] = {0: [], 1: []}
        for resp in stub.Generate(G.GenerateRequest(prompt=PROMPTS[1], sampling_params=params)):
            samples[resp.index] += resp.token_ids
        assert samples[0] == samples[1] == got[1]

        # Beam search (width 3): transformers' beams, best first; the beams fork and free
        # blocks every step, in this family's pool (sliding windows included).
        params = G.SamplingParams(max_tokens=MAX_TOKENS, n=3, use_beam_search=True, ignore_eos=True)
        beams: dict[int, list[int]] = {}
        for resp in stub.Generate(G.GenerateRequest(prompt=PROMPTS[1], sampling_params=params)):
            beams[resp.index] = list(resp.token_ids)
        assert [beams[i] for i in range(3)] == hf_beams(
            hf, tokenizer(PROMPTS[1]).input_ids, 3, MAX_TOKENS
        )

        # The longest prompt twice more, alone: the second time its full blocks come from
        # the prefix cache (the first repeat refills what the others may have evicted).
        _generate(stub, prompt=PROMPTS[2])
        tokens, final = _generate(stub, prompt=PROMPTS[2])
        assert tokens == got[2]
        assert final.usage.cached_prompt_tokens > 0

        # The chat path renders this family's own template.
        messages = [{"role": "user", "content": "Hello there"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        chat = G.ChatMessages(messages=[G.ChatMessage(role="user", content="Hello there")])
        tokens, final = _generate(stub, messages=chat)
        assert final.usage.prompt_tokens == len(ids)
        assert tokens == _hf_greedy(hf, ids)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_a_conversation_the_gemma_template_refuses_is_invalid_argument(family) -> None:
    """Gemma's template raises on roles that do not alternate: the client gets
    INVALID_ARGUMENT naming the messages, and the gateway carries on."""
    _, _, stack = family
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        twice = G.ChatMessages(
            messages=[
                G.ChatMessage(role="user", content="a"),
                G.ChatMessage(role="user", content="b"),
            ]
        )
        with pytest.raises(grpc.RpcError) as info:
            _generate(stub, messages=twice)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages" in (info.value.details() or "")
        tokens, _ = _generate(stub, prompt="The train")
        assert tokens
