"""``--runner pooling``: one vector a prompt, equal to HF ``AutoModel``'s pooled final hidden
states, whatever the chunking, prefix hits or preemption; requests of the other kind are
refused naming the runner."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.outputs import EngineError, RequestErrorCode, SeqOutput
from services.executor.core.pooling import PoolerConfig, PoolingParams, PoolingType, PoolState
from services.executor.core.sequence import RequestKey
from services.executor.model.errors import ModelLoadError
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine


def pooling_engine(model: Path, pooler: dict[str, Any] | None = None, **kw: Any) -> Engine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("device", "cpu")
    config = ExecutorConfig(
        model=str(model),
        dtype="float32",
        runner="pooling",
        pooler_config=json.dumps(pooler) if pooler is not None else None,
        **kw,
    )
    engine, _ = build_engine(config, blockmgr=InProcessClient())
    return engine


def embed_all(engine: Engine, prompts: dict[str, list[int]], **params: Any) -> dict[str, SeqOutput]:
    for rid, prompt in prompts.items():
        engine.add_request(RequestKey(0, rid), prompt, pooling=PoolingParams(**params))
    finals: dict[str, SeqOutput] = {}
    while engine.has_work:
        for out in engine.step():
            assert out.finish_reason is not None and out.embedding is not None  # one output
            finals[out.req_id.request_id] = out
    return finals


@torch.inference_mode()
def hf_embedding(model: Any, prompt: list[int], kind: str, normalize: bool = True) -> torch.Tensor:
    hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    v = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[kind]
    return F.normalize(v, dim=0) if normalize else v


def prompts_of(seed: int, lengths: list[int]) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, 500) for _ in range(n)] for i, n in enumerate(lengths)}


def assert_same_direction(got: list[float], expected: torch.Tensor) -> None:
    cos = F.cosine_similarity(torch.tensor(got), expected, dim=0).item()
    assert cos >= 0.99999, cos
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_hf_pooling_with_chunked_prefill(
    name: str, kind: str, tiny_checkpoint: Any
) -> None:
    """Prompts of 5 to 70 tokens, run together with a budget of 24 tokens a step (so most are
    computed in several chunks), against HF's ``AutoModel`` pooled and normalized."""
    model_dir = tiny_checkpoint(name)
    engine = pooling_engine(model_dir, {"pooling_type": kind}, max_num_batched_tokens=24)
    prompts = prompts_of(1, [5, 17, 40, 70, 24])
    finals = embed_all(engine, prompts)
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    for rid, prompt in prompts.items():
        assert_same_direction(finals[rid].embedding or [], hf_embedding(hf, prompt, kind))
        usage = finals[rid].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
            len(prompt),
            0,
        )
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_usable_blocks  # all freed


def test_last_pooling_hits_the_prefix_cache_and_still_equals_hf(tiny_checkpoint: Any) -> None:
    """LAST pooling reads only the last prompt row: a prompt whose first 48 tokens were
    embedded before computes only the rest, and its vector is HF's."""
    model_dir = tiny_checkpoint("llama")
    engine = pooling_engine(model_dir)
    rng = random.Random(2)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    first = embed_all(engine, {"a": [*shared, 7, 8, 9]})
    second = embed_all(engine, {"b": [*shared, 11, 12, 13, 14]})
    usage = second["b"].usage
    assert usage is not None and usage.cached_prompt_tokens == 48
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_same_direction(first["a"].embedding or [], hf_embedding(hf, [*shared, 7, 8, 9], "LAST"))
    expected = hf_embedding(hf, [*shared, 11, 12, 13, 14], "LAST")
    assert_same_direction(second["b"].embedding or [], expected)


def test_a_recomputed_prompt_is_pooled_over_one_pass() -> None:
    """A prompt computed again from position 0 (preempted by recompute) starts its sum over;
    rows that would skip positions are a bug, never pooled."""
    rows = torch.arange(12.0).reshape(6, 2)
    state = PoolState(PoolingParams())
    state.add(0, rows[:2])
    state.add(2, rows[2:4])
    state.add(0, rows[:3])  # recomputed from the start
    state.add(3, rows[3:])
    torch.testing.assert_close(state.result(PoolingType.MEAN), rows.mean(dim=0))
    torch.testing.assert_close(state.result(PoolingType.CLS), rows[0])
    with pytest.raises(AssertionError, match="pooled rows up to 6, a chunk from 8"):
        state.add(8, rows[:1])


def test_dimensions_truncate_before_normalizing_and_normalize_can_be_off(
    tiny_checkpoint: Any,
) -> None:
    model_dir = tiny_checkpoint("llama")
    prompt = prompts_of(4, [20])["r0"]
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    raw = hf_embedding(hf, prompt, "LAST", normalize=False)
    engine = pooling_engine(model_dir, {"normalize": False})
    got = embed_all(engine, {"r0": prompt})["r0"].embedding or []
    torch.testing.assert_close(torch.tensor(got), raw, rtol=1e-4, atol=1e-4)
    short = embed_all(engine, {"r1": prompt}, dimensions=8, normalize=True)["r1"].embedding or []
    assert len(short) == 8
    torch.testing.assert_close(
        torch.tensor(short), F.normalize(raw[:8], dim=0), rtol=1e-4, atol=1e-4
    )


def test_requests_of_the_other_kind_are_refused_naming_the_runner(tiny_checkpoint: Any) -> None:
    model_dir = tiny_checkpoint("llama")
    engine = pooling_engine(model_dir)
    with pytest.raises(EngineError) as err:
        engine.add_request(RequestKey(0, "g"), [5, 6, 7], SamplingParams(max_tokens=4))
    assert err.value.code is RequestErrorCode.INVALID_ARGUMENT
    assert err.value.message.startswith("sampling_params: this executor runs --runner pooling")
    hidden = engine.hidden_size  # type: ignore[attr-defined]
    with pytest.raises(EngineError, match=r"pooling.dimensions: must be in \[1, \d+\]"):
        engine.add_request(RequestKey(0, "d"), [5, 6], pooling=PoolingParams(hidden + 1))
    assert not engine.has_work
    config = ExecutorConfig(
        model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=512
    )
    generating, _ = build_engine(config, blockmgr=InProcessClient())
    with pytest.raises(EngineError) as err:
        generating.add_request(
            RequestKey(0, "p"), [5, 6], SamplingParams(), pooling=PoolingParams()
        )
    assert err.value.message.startswith("pooling: this executor runs --runner generate")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"pooler_config": '{"pooling_type": "MAX"}'}, "--pooler-config: pooling_type"),
        ({"pooler_config": '{"softmax": true}'}, "--pooler-config: softmax: unknown key"),
        ({"runner": "generate", "pooler_config": "{}"}, "--pooler-config needs --runner pooling"),
        (
            {"pooler_config": '{"classifier_from_token": ["no"]}'},
            "--pooler-config: classifier_from_token: must be two tokens",
        ),
        (
            {"pooler_config": '{"classifier_from_token": ["no", "yes"], "normalize": true}'},
            "--pooler-config: normalize: a classifier's one score is not normalized",
        ),
        (
            {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
            "--speculative-config needs --runner generate",
        ),
    ],
)
def test_bad_pooling_flags_fail_at_once_naming_the_flag(
    flags: dict[str, str], message: str
) -> None:
    flags = {"runner": "pooling", **flags}
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(model="m", **flags)  # type: ignore[arg-type]


def test_pooler_config_reads_vllms_json() -> None:
    assert PoolerConfig.parse(None) == PoolerConfig()
    cfg = PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}')
    assert (cfg.pooling_type.value, cfg.normalize, cfg.every_row) == ("MEAN", False, True)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_a_reranker_scores_sigmoid_of_the_yes_minus_no_logits(
    name: str, tiny_checkpoint: Any
) -> None:
    """``classifier_from_token`` (Qwen3-Reranker's way): one score a prompt,
    sigmoid(logit[yes] - logit[no]) at its last token, equal to HF's causal LM's."""
    model_dir = tiny_checkpoint(name)
    pooler = {"classifier_from_token": ["a", "b"]}  # (single tokens of the tiny tokenizer)
    engine = pooling_engine(model_dir, pooler, max_num_batched_tokens=24)
    prompts = prompts_of(5, [9, 30, 50])
    finals = embed_all(engine, prompts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    no, yes = 70, 71  # "a", "b"
    for rid, prompt in prompts.items():
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0, -1]
        expected = torch.sigmoid(logits[yes] - logits[no]).item()
        got = finals[rid].embedding or []
        assert len(got) == 1 and got[0] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(EngineError, match=r"pooling\.dimensions: this executor scores"):
        engine.add_request(RequestKey(0, "d"), [5, 6], pooling=PoolingParams(dimensions=1))


def test_a_classifier_token_that_is_not_one_token_fails_at_start(tiny_checkpoint: Any) -> None:
    with pytest.raises(ModelLoadError, match="classifier_from_token 'yes' is 2 tokens"):
        pooling_engine(tiny_checkpoint("llama"), {"classifier_from_token": ["a", "yes"]})


@pytest.mark.parametrize(
    ("arch", "num_labels"), [("llama", 3), ("qwen3", 1), ("gemma2", 2), ("phi3", 4)]
)
def test_a_sequence_classifier_scores_its_labels_as_transformers_does(
    arch: str, num_labels: int, tmp_path: Path
) -> None:
    """A ``*ForSequenceClassification`` checkpoint: its score head over the last token's
    state, softmax over its labels (sigmoid for one: a cross-encoder's relevance), equal to
    transformers' logits read that way, whatever the chunking."""
    sizes = {"head_dim": 32} if arch == "qwen3" else {}
    model_dir = write_tiny_model(tmp_path / arch, arch, 30, num_labels=num_labels, **sizes)
    config = ExecutorConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        runner="pooling",
        num_kv_blocks=128,
        max_model_len=512,
        max_num_batched_tokens=24,
    )
    engine, served = build_engine(config, blockmgr=InProcessClient())
    assert served.labels == tuple(f"label_{i}" for i in range(num_labels))
    prompts = prompts_of(7, [6, 31, 52])
    finals = embed_all(engine, prompts)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    for rid, prompt in prompts.items():
        with torch.inference_mode():
            logits = hf.eval()(torch.tensor([prompt])).logits[0]
        expected = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, dim=-1)
        got = torch.tensor(finals[rid].embedding or [])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_classifier_checkpoint_is_refused_by_the_generate_runner_and_a_token_pair(
    tmp_path: Path,
) -> None:
    model_dir = write_tiny_model(tmp_path / "cls", "llama", 31, num_labels=2)
    config = ExecutorConfig(
        model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=512
    )
    with pytest.raises(ModelLoadError, match="serve it with --runner pooling"):
        build_engine(config, blockmgr=InProcessClient())
    with pytest.raises(ModelLoadError, match="a classifier with a score head of its own"):
        pooling_engine(model_dir, {"classifier_from_token": ["a", "b"]})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_embeddings_on_cuda_equal_hf_pooling(kind: str, tiny_checkpoint: Any) -> None:
    """The CUDA path (Triton attention, every row of a chunk for MEAN) in fp32 against HF on
    the CPU."""
    model_dir = tiny_checkpoint("qwen3")
    engine = pooling_engine(
        model_dir, {"pooling_type": kind}, device="cuda", max_num_batched_tokens=24
    )
    prompts = prompts_of(6, [7, 33, 61])
    finals = embed_all(engine, prompts)
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    for rid, prompt in prompts.items():
        assert_same_direction(finals[rid].embedding or [], hf_embedding(hf, prompt, kind))
