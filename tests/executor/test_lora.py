"""Multi-LoRA serving matches PEFT: logits within 1e-4 for every family at ranks 8 and 16, with
and without rsLoRA; a batch mixing the base model and three adapters generates PEFT's greedy
tokens request by request, also under chunked prefill, preemption, prefix hits, async
scheduling and more adapters than slots. An adapter's identity in the prefix cache is its
content: the base model and an adapter, two versions of one name, and an adapter reloaded in
place never share a block."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.outputs import EngineError, RequestErrorCode
from services.executor.core.sequence import RequestKey
from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.launch import build_runner
from services.executor.model.lora.adapter import read_adapter
from services.executor.service.config import ExecutorConfig
from services.executor.service.lora_config import LoRAConfig, LoRAModulePath
from services.executor.service.startup import build_engine

from .conftest import CheckpointFactory, load_runner
from .greedy import shared_prefix_workload

# PEFT is the oracle (a dev dependency); a GPU host without its wheel skips these tests.
PeftModel = pytest.importorskip("peft").PeftModel

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "gemma2",
    "gemma3",
    "gemma3_mm",
)
AdapterFactory = Callable[..., Path]


def peft_model(
    base_dir: Path, adapters: dict[str, Path], dtype: torch.dtype = torch.float32
) -> PeftModel:
    """A fresh transformers model of ``base_dir`` with ``adapters`` loaded by name."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.inference_mode()
def peft_greedy(model: PeftModel, prompt: list[int], max_tokens: int, adapter: str) -> list[int]:
    """PEFT's mixed-batch ``generate(adapter_names=[...])`` for one request ('' = base)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        adapter_names=[adapter or "__base__"],
    )
    return out[0, len(prompt) :].tolist()


def lora_engine(model_dir: Path, adapters: dict[str, Path], **overrides: Any) -> Engine:
    lora = LoRAConfig(
        enable_lora=True,
        max_loras=overrides.pop("max_loras", 4),
        max_lora_rank=16,
        max_cpu_loras=overrides.pop("max_cpu_loras", None),
        lora_modules=tuple(LoRAModulePath(n, str(p)) for n, p in adapters.items()),
    )
    settings: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "block_size": 8,
        "num_kv_blocks": 128,
        "max_model_len": 256,
    }
    config = ExecutorConfig(model=str(model_dir), lora=lora, **(settings | overrides))
    engine, _ = build_engine(
        config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient()
    )
    return engine


def run(
    engine: Engine, requests: dict[str, tuple[list[int], int, str]]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy ``requests`` (id -> prompt, max_tokens, adapter) to the end: tokens and cached
    prompt tokens per request."""
    for rid, (prompt, max_tokens, adapter) in requests.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(RequestKey(0, rid), prompt, params, lora_name=adapter)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_work:
        for out in engine.step():
            tokens.setdefault(out.req_id.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None and out.usage is not None:
                cached[out.req_id.request_id] = out.usage.cached_prompt_tokens
    return tokens, cached


PROMPTS = [
    [1, *range(40, 75)],
    [1, 9, 300, 42, 17, 8, 5, 77],
    [1, *range(200, 231, 2)],
]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("rank", "use_rslora"), [(8, False), (16, True)])
def test_adapter_logits_match_peft_for_every_family(
    name: str,
    rank: int,
    use_rslora: bool,
    tiny_checkpoint: CheckpointFactory,
    lora_adapter: AdapterFactory,
) -> None:
    """One forward with a base row and an adapter row (every prompt position's logits)."""
    base_dir = tiny_checkpoint(name)
    adapter_dir = lora_adapter(name, 1, rank, use_rslora)
    runner = load_runner(base_dir, dtype="float32", num_kv_blocks=32)
    slots = runner.attach_lora(2, 16)
    m = runner.model
    slots.register(7, read_adapter(adapter_dir, m.config, m.dtype, 16, m.checkpoint_name))
    prompt = PROMPTS[0]
    logits = runner.execute(
        [
            SeqChunk(prompt, 0, [1, 2, 3], all_logits=True),
            SeqChunk(prompt, 0, [4, 5, 6], all_logits=True, lora_id=7),
        ]
    )
    model = peft_model(base_dir, {"a": adapter_dir})
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        expected = model(ids, adapter_names=["a"]).logits[0]
        base = model(ids, adapter_names=["__base__"]).logits[0]
    n = len(prompt)
    assert (logits[n:] - expected).abs().max().item() < 1e-4
    assert (logits[:n] - base).abs().max().item() < 1e-4
    assert (expected - base).abs().max().item() > 0.5  # the adapter does change the model


@pytest.mark.parametrize("name", FAMILIES)
def test_a_batch_of_the_base_model_and_three_adapters_matches_peft_request_by_request(
    name: str, tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    base_dir = tiny_checkpoint(name)
    adapters = {
        "a8": lora_adapter(name, 1, 8),
        "a16rs": lora_adapter(name, 2, 16, True),
        "a8rs": lora_adapter(name, 3, 8, True),
    }
    engine = lora_engine(base_dir, adapters)
    requests = {
        f"{adapter or 'base'}-{i}": (prompt, 10, adapter)
        for adapter in ("", *adapters)
        for i, prompt in enumerate(PROMPTS[:2])
    }
    tokens, _ = run(engine, requests)
    model = peft_model(base_dir, adapters)
    expected = {rid: peft_greedy(model, p, n, a) for rid, (p, n, a) in requests.items()}
    assert tokens == expected
    assert expected["a8-0"] != expected["base-0"]


@pytest.mark.parametrize(
    "overrides",
    [
        # prompts in chunks of 24 tokens, too few blocks for all at once, shared prefixes
        {"max_num_batched_tokens": 24, "num_kv_blocks": 16, "max_model_len": 96},
        {"async_scheduling": True},
    ],
    ids=["chunked-preempted-prefix-hits", "async"],
)
def test_adapters_match_peft_under_chunking_preemption_prefix_hits_and_async_scheduling(
    overrides: dict[str, Any], tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    base_dir = tiny_checkpoint("llama")
    adapters = {"x": lora_adapter("llama", 4), "y": lora_adapter("llama", 5, 16, True)}
    model = peft_model(base_dir, adapters)
    workload = shared_prefix_workload(
        model.get_base_model(), seed=5, num_requests=12, prefix_len=33, max_tail=20,
        max_tokens=(6, 18),
    )  # fmt: skip
    names = ("", "x", "y")  # the odd requests share a prefix: two of them per adapter
    requests = {f"r{i}": (p, n, names[i // 2 % 3]) for i, (p, n, _) in enumerate(workload)}
    engine = lora_engine(base_dir, adapters, **overrides)
    tokens, cached = run(engine, requests)
    for rid, (prompt, n, adapter) in requests.items():
        assert tokens[rid] == peft_greedy(model, prompt, n, adapter), rid
    if "num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
        assert sum(cached.values()) > 0


def test_more_adapters_than_slots_wait_their_turn_and_never_share_a_forward(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    """``max_loras=1``: three adapters and the base model, queued together; no forward ever
    runs two adapters, every request ends with PEFT's tokens (none starves)."""
    base_dir = tiny_checkpoint("llama")
    adapters = {f"a{i}": lora_adapter("llama", 10 + i) for i in range(3)}
    engine = lora_engine(base_dir, adapters, max_loras=1)
    slots = engine.runner.lora  # type: ignore[attr-defined]
    seen: list[int] = []
    activate = slots.activate

    def spy(rows: Any) -> Any:
        mapping = activate(rows)
        seen.append(mapping.num_adapters)
        return mapping

    slots.activate = spy
    requests = {
        f"{a or 'base'}-{i}": (p, 6, a) for i, p in enumerate(PROMPTS) for a in ("", *adapters)
    }
    tokens, _ = run(engine, requests)
    model = peft_model(base_dir, adapters)
    for rid, (prompt, n, adapter) in requests.items():
        assert tokens[rid] == peft_greedy(model, prompt, n, adapter), rid
    assert max(seen) == 1 and len(seen) > 3


# ---- the adapter's identity in the prefix cache ---------------------------------------------


def test_the_base_model_and_an_adapter_never_hit_each_others_blocks(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    base_dir = tiny_checkpoint("llama")
    engine = lora_engine(base_dir, {"a": lora_adapter("llama", 1)})
    prompt = PROMPTS[0]
    run(engine, {"base": (prompt, 2, "")})
    _, cached_a = run(engine, {"adapter": (prompt, 2, "a")})
    _, again = run(engine, {"base-again": (prompt, 2, ""), "adapter-again": (prompt, 2, "a")})
    assert cached_a["adapter"] == 0
    assert again["base-again"] > 0 and again["adapter-again"] > 0  # each hits its own


def test_a_name_loaded_again_with_new_weights_never_hits_the_old_blocks(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    base_dir = tiny_checkpoint("llama")
    old, new = lora_adapter("llama", 1), lora_adapter("llama", 2)
    engine = lora_engine(base_dir, {"a": old})
    prompt = PROMPTS[0]
    run(engine, {"old": (prompt, 6, "a")})
    engine.adapters.unload("a")
    engine.adapters.load("a", str(new))
    tokens, cached = run(engine, {"new": (prompt, 6, "a")})
    assert cached["new"] == 0
    assert tokens["new"] == peft_greedy(peft_model(base_dir, {"a": new}), prompt, 6, "a")


def test_an_adapter_reloaded_in_place_serves_its_new_weights_from_its_own_blocks(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory, tmp_path: Path
) -> None:
    """Same name, same directory, new files (``replace``): no block of the old version is
    hit, and the tokens are the new weights'. Reloading identical files does share them."""
    base_dir = tiny_checkpoint("llama")
    live = tmp_path / "adapter"
    shutil.copytree(lora_adapter("llama", 1), live)
    engine = lora_engine(base_dir, {"a": live})
    prompt = PROMPTS[0]
    run(engine, {"v1": (prompt, 6, "a")})
    shutil.copytree(lora_adapter("llama", 2), live, dirs_exist_ok=True)
    engine.adapters.load("a", str(live), replace=True)
    tokens, cached = run(engine, {"v2": (prompt, 6, "a")})
    assert cached["v2"] == 0
    assert tokens["v2"] == peft_greedy(peft_model(base_dir, {"a": live}), prompt, 6, "a")
    engine.adapters.load("a", str(live), replace=True)  # the same content: the same identity
    _, cached = run(engine, {"v2-again": (prompt, 6, "a")})
    assert cached["v2-again"] > 0


# ---- the registry -----------------------------------------------------------------------


def test_an_unknown_adapter_is_not_found_and_nothing_is_queued(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    engine = lora_engine(tiny_checkpoint("llama"), {"a": lora_adapter("llama", 1)})
    with pytest.raises(EngineError) as err:
        engine.add_request(RequestKey(0, "r"), PROMPTS[1], SamplingParams(), lora_name="zz")
    assert err.value.code is RequestErrorCode.NOT_FOUND and "'zz'" in err.value.message
    assert not engine.has_work


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_finish(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    engine = lora_engine(tiny_checkpoint("llama"), {"a": lora_adapter("llama", 1)})
    engine.add_request(RequestKey(0, "r"), PROMPTS[1], SamplingParams(max_tokens=3), lora_name="a")
    with pytest.raises(EngineError) as err:
        engine.adapters.unload("a")
    assert err.value.code is RequestErrorCode.FAILED_PRECONDITION
    while engine.has_work:
        engine.step()
    engine.adapters.unload("a")
    assert engine.adapters.names == {} and engine.runner.lora.adapters == {}  # type: ignore[attr-defined]


def test_idle_adapters_beyond_max_cpu_loras_are_read_again_and_refused_if_changed(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory, tmp_path: Path
) -> None:
    base_dir = tiny_checkpoint("llama")
    live = tmp_path / "b"
    shutil.copytree(lora_adapter("llama", 2), live)
    adapters = {"a": lora_adapter("llama", 1), "b": live}
    engine = lora_engine(base_dir, adapters, max_loras=1, max_cpu_loras=1)
    slots = engine.runner.lora  # type: ignore[attr-defined]
    assert len(slots.adapters) == 1  # "a" was dropped from host memory when "b" loaded
    tokens, _ = run(engine, {"ra": (PROMPTS[1], 5, "a")})  # read again from its directory
    assert tokens["ra"] == peft_greedy(peft_model(base_dir, adapters), PROMPTS[1], 5, "a")
    shutil.copytree(lora_adapter("llama", 3), live, dirs_exist_ok=True)  # b dropped, changed
    with pytest.raises(EngineError) as err:
        engine.add_request(RequestKey(0, "rb"), PROMPTS[1], SamplingParams(), lora_name="b")
    assert err.value.code is RequestErrorCode.FAILED_PRECONDITION
    assert "changed" in err.value.message


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_adapters_pagedserve_cannot_serve_are_refused_naming_the_field(
    edit: dict[str, Any],
    field: str,
    tiny_checkpoint: CheckpointFactory,
    lora_adapter: AdapterFactory,
    tmp_path: Path,
) -> None:
    adapter = tmp_path / "bad"
    shutil.copytree(lora_adapter("llama", 1), adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | edit))
    engine = lora_engine(tiny_checkpoint("llama"), {})
    with pytest.raises(EngineError) as err:
        engine.adapters.load("bad", str(adapter))
    assert err.value.code is RequestErrorCode.INVALID_ARGUMENT
    assert err.value.message.startswith(f"{field}:")


def test_a_rank_over_the_limit_another_base_model_and_expert_modules_are_refused(
    tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    llama = load_runner(tiny_checkpoint("llama"), dtype="float32", num_kv_blocks=8).model
    with pytest.raises(ModelLoadError, match="rank 16, over max_lora_rank=8"):
        read_adapter(lora_adapter("llama", 1, 16), llama.config, llama.dtype, 8)
    with pytest.raises(ModelLoadError, match="another base model"):  # a narrower model's adapter
        read_adapter(lora_adapter("llama_head_dim", 1), llama.config, llama.dtype, 16)
    mixtral = load_runner(tiny_checkpoint("mixtral"), dtype="float32", num_kv_blocks=8).model
    with pytest.raises(ModelLoadError, match=r"target_modules: .*mixture of experts"):
        read_adapter(lora_adapter("llama", 1), mixtral.config, mixtral.dtype, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_on_cuda_use_the_punica_kernels_and_match_peft(
    dtype: str, tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    """The CUDA path (per-row slot index, Triton shrink / expand) against PEFT in fp32 on the
    CPU: a base row and rows of two adapters in one forward."""
    base_dir = tiny_checkpoint("llama")
    adapters = {"a": lora_adapter("llama", 1), "b": lora_adapter("llama", 2, 16, True)}
    # eager: a runner attaches LoRA before any graph capture, as build_runner does
    runner = load_runner(base_dir, dtype=dtype, device="cuda", num_kv_blocks=32, enforce_eager=True)
    slots = runner.attach_lora(2, 16)
    m = runner.model
    for i, path in enumerate(adapters.values(), start=1):
        slots.register(i, read_adapter(path, m.config, m.dtype, 16, m.checkpoint_name))
    prompt = PROMPTS[0]
    chunks = [
        SeqChunk(prompt, 0, [1 + 3 * j, 2 + 3 * j, 3 + 3 * j], all_logits=True, lora_id=j)
        for j in range(3)
    ]
    logits = runner.execute(chunks).cpu()
    assert slots.context.mapping.token_slots is not None  # the kernels' path
    model = peft_model(base_dir, adapters)
    # bf16's own error on each row: PEFT in bf16 (on the CPU) against PEFT in fp32
    model_bf16 = peft_model(base_dir, adapters, torch.bfloat16) if dtype == "bfloat16" else None
    n = len(prompt)
    errors, own_errors, deltas = {}, {}, {}
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        base_logits = model(ids, adapter_names=["__base__"]).logits[0]
        for j, name in enumerate(("__base__", "a", "b")):
            expected = model(ids, adapter_names=[name]).logits[0]
            errors[name] = (logits[j * n : (j + 1) * n] - expected).abs().max().item()
            deltas[name] = (expected - base_logits).abs().max().item()
            if model_bf16 is not None:
                theirs = model_bf16(ids, adapter_names=[name]).logits[0].float()
                own_errors[name] = (theirs - expected).abs().max().item()
    if dtype == "float32":
        assert max(errors.values()) < 1e-3, errors
    else:
        # bf16 against PEFT's fp32 may err as much as PEFT's own bf16 does, up to the other
        # roundings of another device's GEMMs (measured on an H200: 1.2-1.9x); a row whose
        # adapter were dropped or misscaled would err by the adapter's whole effect (~13).
        for name in errors:
            assert errors[name] < 2 * own_errors[name] + 0.1, (errors, own_errors)
        assert max(errors["a"], errors["b"]) < 0.25 * min(deltas["a"], deltas["b"]), (
            errors,
            deltas,
        )


@pytest.mark.parametrize("name", ["llama", "phi3", "llama_odd_sizes"])
def test_adapters_sharded_over_two_ranks_match_peft(
    name: str, tiny_checkpoint: CheckpointFactory, lora_adapter: AdapterFactory
) -> None:
    """TP = 2: every rank holds its shard of each slot (B's rows of q/k/v and gate/up, A's
    columns of o and down; Phi-3's fused modules; an MLP width the ranks pad), adapters
    registered, mapped and forgotten on every rank alike."""
    base_dir = tiny_checkpoint(name)
    adapters = {"a": lora_adapter(name, 1), "b": lora_adapter(name, 2, 16, True)}
    lora = LoRAConfig(
        enable_lora=True,
        max_loras=1,  # the two adapters take turns in one slot: loads on both ranks
        max_lora_rank=16,
        lora_modules=tuple(LoRAModulePath(n, str(p)) for n, p in adapters.items()),
    )
    config = ExecutorConfig(
        model=str(base_dir),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        lora=lora,
    )
    runner = build_runner(config.runner_config())
    try:
        engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
        requests = {
            f"{a or 'base'}-{i}": (p, 8, a)
            for i, p in enumerate(PROMPTS[:2])
            for a in ("", "a", "b")
        }
        tokens, _ = run(engine, requests)
        engine.adapters.unload("b")  # forgotten on every rank
        more, _ = run(engine, {"a-again": (PROMPTS[0], 8, "a")})
    finally:
        runner.close()
    assert runner.workers is not None
    assert all(p.exitcode == 0 for p in runner.workers.processes)
    model = peft_model(base_dir, adapters)
    for rid, (prompt, n, adapter) in requests.items():
        assert tokens[rid] == peft_greedy(model, prompt, n, adapter), rid
    assert more["a-again"] == tokens["a-0"]
