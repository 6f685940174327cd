"""Speculative decoding with an EAGLE-3 head: the head reads the target's features (the
residual streams entering three of its layers) and drafts k tokens a step from its own
one-layer KV cache over the target's blocks. The paged head computes what a dense reference
computes; a head trained for a few seconds on the model's own tokens has most drafts
accepted; outputs are token-identical to the engine without speculation and to
transformers, whatever the batching, chunking, preemption, prefix hits, sampling or grammar.
Each case checks that drafts were made and accepted, so it cannot pass vacuously."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.tools.eagle3_head import Eagle3Reference, target_features, write_random_head
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.model.eagle import Eagle3Runner, load_eagle3
from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.launch import build_runner
from services.executor.model.loader import load_model
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine
from tests.executor.greedy import run_engine
from tests.executor.test_draft_model import _config
from tests.executor.test_speculative import (
    CONFIGS,
    _engine,
    _requests,
    _spec_counts,
    assert_preempted_as_configured,
    assert_transformers_tokens,
    with_and_without,
)
from tests.executor.test_structured_outputs import SPECS

K = 3


def _spec(head: object, k: int = K, **more: int) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k, **more})


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def head_dir(eagle3_head) -> str:
    return str(eagle3_head("llama"))


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gemma2"])
def test_the_targets_features_are_the_residual_streams_transformers_returns(
    name, tiny_checkpoint, hf_model
):
    """The forward keeps the residual stream entering each feature layer, in layer order:
    transformers' ``hidden_states[i]`` (Gemma's scaled embeddings for layer 0)."""
    config = _config(str(tiny_checkpoint(name)), disable_hybrid_kv_cache_manager=True)
    runner = build_runner(config.runner_config())
    runner.model.aux_layers = (0, 1, 1)
    prompt = _requests(seed=3, num=1)["r0"][0]
    runner.execute([SeqChunk(prompt, 0, list(range(1, 1 + -(-len(prompt) // 8))))])
    expected = target_features(hf_model(name), torch.tensor([prompt]), (0, 1, 1))[0]
    assert runner.aux_hidden is not None
    torch.testing.assert_close(runner.aux_hidden, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options",
    [{}, {"draft_vocab_size": 97}, {"norm_before_residual": True}],
    ids=["full-vocab", "draft-vocab", "norm-before-residual"],
)
def test_the_paged_head_drafts_what_the_dense_reference_drafts(
    model_dir, hf_model, tmp_path, options
):
    """A prefill of the target's features, then two drafts fed back from the head's own
    output, at the positions drafting uses: the paged head's logits (draft ids mapped to the
    target's by ``d2t``, the others -inf) are the dense reference's."""
    head_dir = write_random_head(Path(model_dir), tmp_path / "head", seed=3, **options)
    head = load_eagle3(str(head_dir), load_model(model_dir, dtype=torch.float32), model_dir)
    runner = Eagle3Runner(head, num_blocks=16, block_size=8)
    reference = Eagle3Reference(json.loads((head_dir / "config.json").read_text()))
    reference.load_state_dict(load_file(head_dir / "model.safetensors"), strict=False)
    tokens = torch.tensor([_requests(seed=2, num=1)["r0"][0][:30]])
    n = tokens.shape[1] - 3  # features of positions 0 .. n-1
    features = target_features(hf_model("llama"), tokens[:, :n], head.config.aux_layers)
    with torch.no_grad():
        steps = reference(tokens, features, depth=3)
    vocab = head.config.model.vocab_size
    table = [1, 2, 3, 4]
    logits, state = runner.execute([SeqChunk(tokens[0, 1 : n + 1].tolist(), 0, table)], features[0])
    for s in (1, 2, 3):
        expected = reference.target_logits(steps[s - 1][0][0, n - 1], vocab)
        assert torch.equal(torch.isinf(logits[0]), torch.isinf(expected))
        finite = torch.isfinite(expected)
        torch.testing.assert_close(logits[0][finite], expected[finite], atol=1e-4, rtol=1e-4)
        if s < 3:
            chunk = SeqChunk([int(tokens[0, n + s])], n - 1 + s, table)
            logits, state = runner.execute([chunk], state)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_eagle3_speculation_gives_the_tokens_of_the_engine_without_it(model_dir, head_dir, config):
    requests = _requests(seed=1, num=12)
    (plain, plain_finals), (spec, finals), engine = with_and_without(
        model_dir, requests, _spec(head_dir), CONFIGS[config]
    )
    assert spec == plain
    assert {k: f.finish_reason for k, f in finals.items()} == {
        k: f.finish_reason for k, f in plain_finals.items()
    }
    drafted, accepted = _spec_counts(engine)
    assert 0 < accepted <= drafted, (drafted, accepted)
    assert_preempted_as_configured(engine, CONFIGS[config])


def test_while_speculation_is_off_for_a_large_batch_the_head_skips_and_drafts_again_later(
    model_dir, head_dir
):
    """Off for a batch of 6 or more (each request has its own length, so the batch shrinks):
    the head neither drafts nor catches up on those steps, then drafts from a stale cache;
    the tokens are the same, and drafts are accepted once it drafts again."""
    requests = {
        rid: (prompt, dataclasses.replace(params, ignore_eos=True, max_tokens=20 + 8 * i))
        for i, (rid, (prompt, params)) in enumerate(_requests(seed=1, num=12).items())
    }
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(head_dir, disable_by_batch_size=6))
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[1] > 0


def test_a_trained_head_has_most_drafts_accepted(model_dir, head_dir):
    """Trained on these prompts' greedy tokens, the head drafts them: the mean acceptance
    length is near k + 1 at every draft position."""
    engine = _engine(model_dir, speculative_config=_spec(head_dir))
    run_engine(engine, _requests(seed=1, num=12))
    stats = engine.spec.stats
    assert stats.mean_acceptance_length > 1 + 0.8 * K, stats.mean_acceptance_length
    assert min(stats.accepted_per_pos) > 0.7 * stats.num_drafts


@pytest.mark.parametrize(
    "name", ["qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3"]
)
def test_every_family_with_full_attention_layers_drafts_with_transformers_tokens(
    name, tiny_checkpoint, eagle3_head, hf_model
):
    """Each family's features feed its own trained head; Gemma's head reads the
    full-attention group's tables beside the sliding layers' windows of 16 tokens."""
    engine = _engine(str(tiny_checkpoint(name)), speculative_config=_spec(eagle3_head(name)))
    assert_transformers_tokens(engine, _requests(seed=1, num=8, max_tokens=60), hf_model(name))


@pytest.mark.parametrize(
    "overrides",
    [
        {"temperature": 0.9, "seed": 5},
        {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2, "n": 2},
        {"temperature": 0.0, "structured_outputs": SPECS["json"], "max_tokens": 60},
    ],
    ids=["seeded", "penalties-logprobs-n2", "json"],
)
def test_sampled_and_structured_requests_give_the_outputs_of_the_engine_without_it(
    model_dir, head_dir, overrides
):
    requests = {
        rid: (prompt, dataclasses.replace(params, **overrides))
        for rid, (prompt, params) in _requests(seed=1, num=8, max_tokens=80).items()
    }
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(head_dir))
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[0] > 0


def test_prefix_hits_stop_one_block_short_and_still_draft(model_dir, head_dir):
    """The same prompts twice: the second time their hits stop one block short of what the
    engine without a head hits (the head's KV at a block's last position depends on the
    token after it), and the tokens and acceptance stay."""
    requests = _requests(seed=1, num=6)
    hits = {}
    for spec in (None, _spec(head_dir)):
        engine = _engine(model_dir, speculative_config=spec, enable_prefix_caching=True)
        first, _ = run_engine(engine, requests)
        again, finals = run_engine(engine, {f"{rid}-again": v for rid, v in requests.items()})
        assert {(rid.removesuffix("-again"), i): t for (rid, i), t in again.items()} == first
        hits[spec] = {k: f.usage.cached_prompt_tokens for k, f in finals.items()}
    block_size = engine.runner.block_size
    plain, eagle = hits[None], hits[_spec(head_dir)]
    assert any(plain.values())
    assert eagle == {k: max(0, n - block_size) for k, n in plain.items()}
    assert _spec_counts(engine)[1] > 0


def test_the_cache_budget_pays_for_the_heads_blocks(model_dir, head_dir):
    """Each block costs the target's bytes (2 layers) and the head's (1 layer of the same
    shape): two thirds of the blocks."""
    budget = 6 * 2**20
    plain = build_runner(_config(model_dir, kv_cache_memory=budget).runner_config())
    config = _config(model_dir, kv_cache_memory=budget, speculative_config=_spec(head_dir))
    runner = build_runner(config.runner_config())
    assert runner.eagle is not None and runner.model.aux_layers
    assert runner.num_blocks == plain.num_blocks * 2 // 3
    assert runner.eagle.kv_cache.shape[2] == runner.num_blocks


def test_make_tiny_model_writes_a_random_head_the_executor_serves(model_dir, tmp_path):
    from pagedserve.tools.tiny_model import main

    assert main([str(tmp_path / "head"), "--eagle3-for", model_dir, "--seed", "4"]) == 0
    requests = _requests(seed=1, num=4, max_tokens=20)
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(tmp_path / "head"))
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[0] > 0  # (a random head's drafts are rarely accepted)


def test_eagle3_without_a_head_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"speculative_config\.model: eagle3 needs"):
        ExecutorConfig(model="m", speculative_config='{"method": "eagle3"}').validate()


def _break(head: Path, tmp_path: Path, config: dict | None = None, drop: str = "") -> Path:
    out = tmp_path / "broken"
    out.mkdir()
    cfg = {**json.loads((head / "config.json").read_text()), **(config or {})}
    (out / "config.json").write_text(json.dumps(cfg))
    weights = {k: v for k, v in load_file(head / "model.safetensors").items() if k != drop}
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    ("config", "drop", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "", "is not an EAGLE-3 head"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "", "must be 3"),
        ({"target_hidden_size": 32}, "", "target_hidden_size 32 is not"),
        ({"num_hidden_layers": 2}, "", "num_hidden_layers must be 1"),
        ({"vocab_size": 7}, "", "vocab_size 7 is not the target's"),
        (None, "fc.weight", "lacks ['fc.weight']"),
    ],
    ids=["architecture", "aux-layers", "target-hidden", "layers", "vocab", "missing-tensor"],
)
def test_a_head_that_cannot_serve_the_target_is_a_load_error_naming_the_field(
    model_dir, head_dir, tmp_path, config, drop, message
):
    broken = _break(Path(head_dir), tmp_path, config, drop)
    cfg = _config(model_dir, speculative_config=_spec(broken))
    with pytest.raises(ModelLoadError, match=r"^speculative_config\.model: ") as info:
        build_engine(cfg, runner=build_runner(cfg.runner_config()), blockmgr=InProcessClient())
    assert message in str(info.value)


@pytest.mark.gpu
def test_on_cuda_eagle3_speculation_gives_the_tokens_of_graphed_decoding(model_dir, head_dir):
    """On a GPU: the plain engine decodes through CUDA graphs; the speculating one verifies
    through the verification graphs, which keep the features the head reads, and the head
    drafts through graphs of its own (its catch-up is eager). fp32 tokens are identical."""
    requests = _requests(seed=1, num=12)
    plain, _ = run_engine(_engine(model_dir, device="cuda"), requests)
    engine = _engine(model_dir, device="cuda", speculative_config=_spec(head_dir))
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[1] > 0
    assert engine.runner.graphs.num_verify_replays > 0  # type: ignore[attr-defined]
    assert engine.runner.eagle.graphs.num_replays > 0  # type: ignore[attr-defined]


def test_under_graphs_the_head_reads_the_features_an_eager_forward_leaves(
    model_dir, head_dir
) -> None:
    """The graphs (the eager stand-in replaying over the persistent buffers) keep the
    target's features as outputs of their own; a verification graph's are gathered back to
    the eager rows; the head's own drafting forwards replay graphs of theirs, fed its state
    through a persistent buffer: the same drafts accepted and the same tokens as without
    graphs."""
    # Outputs of 20-70 tokens: speculation is off while more than 4 run (decode graphs,
    # the head catching up on their features), then on (verification graphs).
    requests = {
        rid: (prompt, SamplingParams(temperature=0.0, max_tokens=20 + 10 * i))
        for i, (rid, (prompt, _)) in enumerate(_requests(seed=1, num=6).items())
    }
    spec = _spec(head_dir, disable_by_batch_size=4)
    plain, _ = run_engine(_engine(model_dir), requests)
    eager = _engine(model_dir, speculative_config=spec)
    eager_tokens, _ = run_engine(eager, requests)
    graphed = _engine(
        model_dir,
        speculative_config=spec,
        graph_backend="eager",
        cuda_graph_sizes=(1, 2, 4, 8, 16, 24, 32, 40),
    )
    tokens, _ = run_engine(graphed, requests)
    assert tokens == eager_tokens == plain
    graphs = graphed.runner.graphs  # type: ignore[attr-defined]
    assert graphs.num_verify_replays > 0 and graphs.num_replays > graphs.num_verify_replays
    assert graphed.runner.eagle.graphs.num_replays > 0  # type: ignore[attr-defined]
    assert _spec_counts(graphed) == _spec_counts(eager)
    assert _spec_counts(graphed)[1] > 0
