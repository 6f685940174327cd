"""Mixtures of experts (Mixtral, Qwen3-MoE): the layer against transformers' sparse block bit
for bit, every expert cut over tensor-parallel ranks (gloo on the CPU) with greedy parity
against transformers, widths the ranks do not divide, and the model over the Triton
kernels under the interpreter.

Greedy parity at TP 2 and 4 against one rank is in ``test_tensor_parallel.py``
(``PARITY_MODELS``); parity of one rank with transformers in ``test_matches_transformers.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedModel, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedserve.kernels.ops import FORCE_TRITON_ENV
from pagedserve.tools.tiny_model import write_tiny_model
from services.executor.model.config import MoEConfig
from services.executor.model.layers.moe import SparseMoE
from services.executor.model.loader import read_model_config
from services.executor.model.parallel import ShardPlan
from services.executor.model.runner import ModelRunner

from .conftest import load_runner
from .greedy import BlockAllocator, GreedySeq, hf_greedy, run_greedy

MAX_NEW_TOKENS = 8


# ---- the layer against transformers' block ------------------------------------------------


def _hf_block(arch: str, num_experts: int, top_k: int, renormalize: bool) -> torch.nn.Module:
    # The eager expert loop (transformers' default on the CPU is torch._grouped_mm).
    common = {"hidden_size": 48, "num_experts_per_tok": top_k, "experts_implementation": "eager"}
    block: torch.nn.Module
    if arch == "mixtral":
        block = MixtralSparseMoeBlock(
            MixtralConfig(**common, intermediate_size=40, num_local_experts=num_experts)
        )
    else:
        block = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(
                **common,
                moe_intermediate_size=40,
                num_experts=num_experts,
                norm_topk_prob=renormalize,
            )
        )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block.eval()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run with this many torch threads (BLAS may split rows differently), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("arch", "num_experts", "top_k", "renormalize"),
    [("mixtral", 8, 2, True), ("qwen3_moe", 8, 3, False), ("qwen3_moe", 16, 4, True)],
)
def test_the_layer_is_bit_identical_to_transformers_sparse_block(
    arch, num_experts, top_k, renormalize, torch_threads
):
    """fp32 on one rank: the same routing, each expert on the same rows in the same order,
    each token's terms added in transformers' order; for 37 tokens and for one (most
    experts idle)."""
    hf = _hf_block(arch, num_experts, top_k, renormalize)
    moe = MoEConfig(num_experts, top_k, 40, renormalize, layers=(0,))
    ours = SparseMoE(48, moe, torch.float32).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)
        ours.w2.copy_(hf.experts.down_proj)
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x[None])[0])
        assert torch.equal(ours(x[:1]), hf(x[None, :1])[0])


# ---- the shard plan -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE with a dense layer of width 126 and experts of width 63: 4 ranks divide
    neither, so both are padded (and differently)."""
    return write_tiny_model(
        tmp_path_factory.mktemp("moe") / "qwen3_moe_odd",
        arch="qwen3_moe",
        seed=31,
        intermediate_size=126,
    )


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_expert_and_dense_row_is_cut_once_over_the_ranks(
    tiny_checkpoint, odd_moe_checkpoint, size
):
    for path in (tiny_checkpoint("mixtral"), tiny_checkpoint("qwen3_moe"), odd_moe_checkpoint):
        c = read_model_config(path)
        assert c.moe is not None
        plans = [ShardPlan.of(c, rank, size) for rank in range(size)]
        # The dense layers' width and the experts' width, each cut on its own.
        for kind, width in (("", c.intermediate_size), ("moe_", c.moe.intermediate_size)):
            held = []
            for p in plans:
                start = getattr(p, f"{kind}intermediate_start")
                held += range(start, start + getattr(p, f"num_real_{kind}intermediate"))
            assert held == list(range(width))
            assert all(getattr(p, f"{kind}intermediate_rows") == -(-width // size) for p in plans)
        for p in plans:
            local = p.local_config(c)
            assert local.intermediate_size == p.intermediate_rows
            assert local.moe is not None
            assert local.moe.intermediate_size == p.moe_intermediate_rows
            assert local.moe.num_experts == c.moe.num_experts  # every rank holds every expert


def test_odd_widths_pad_the_last_rank(odd_moe_checkpoint):
    c = read_model_config(odd_moe_checkpoint)
    assert c.moe is not None and (c.intermediate_size, c.moe.intermediate_size) == (126, 63)
    last = ShardPlan.of(c, 3, 4)
    assert (last.intermediate_rows, last.num_real_intermediate) == (32, 30)
    assert (last.moe_intermediate_rows, last.num_real_moe_intermediate) == (16, 15)


# ---- tensor parallelism, end to end -------------------------------------------------------


@pytest.fixture
def runners() -> Iterator[Callable[..., ModelRunner]]:
    """``runners(model_dir, **config)``: fp32 CPU runners, closed at the end of the test."""
    made: list[ModelRunner] = []

    def make(model_dir: Path, **config: object) -> ModelRunner:
        made.append(load_runner(model_dir, dtype="float32", **config))
        return made[-1]

    yield make
    for runner in made:
        runner.close()


def _greedy_batch(runner: ModelRunner, prompts: list[list[int]]) -> list[GreedySeq]:
    """The prompts batched, staggered, with chunked prefill."""
    seqs = [GreedySeq(list(p), MAX_NEW_TOKENS, start_step=i) for i, p in enumerate(prompts)]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=12)
    return seqs


def _assert_transformers_greedy(
    seqs: list[GreedySeq], hf: PreTrainedModel, prompts: list[list[int]]
) -> None:
    for seq, prompt in zip(seqs, prompts, strict=True):
        tokens, logits = hf_greedy(hf, prompt, MAX_NEW_TOKENS)
        assert seq.output == tokens, f"prompt of {len(prompt)} tokens"
        for ours, ref in zip(seq.logits, logits, strict=True):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_experts_at_tp2_give_transformers_tokens(
    name, tiny_checkpoint, hf_model, prompt_ids, runners
):
    runner = runners(tiny_checkpoint(name), tensor_parallel_size=2)
    assert runner.model.shard.size == 2
    layer = runner.model.layers[-1].mlp
    assert isinstance(layer, SparseMoE)
    assert layer.w13.shape[1] == read_model_config(tiny_checkpoint(name)).moe.intermediate_size
    _assert_transformers_greedy(_greedy_batch(runner, prompt_ids), hf_model(name), prompt_ids)


def test_padded_experts_and_dense_layer_at_tp4_give_transformers_tokens(
    odd_moe_checkpoint, prompt_ids, runners
):
    hf = AutoModelForCausalLM.from_pretrained(  # _grouped_mm wants 16-byte strides: not 63
        odd_moe_checkpoint,
        dtype=torch.float32,
        local_files_only=True,
        experts_implementation="eager",
    ).eval()
    runner = runners(odd_moe_checkpoint, tensor_parallel_size=4)
    dense, sparse = runner.model.layers[0].mlp, runner.model.layers[1].mlp
    assert isinstance(sparse, SparseMoE) and not isinstance(dense, SparseMoE)
    assert sparse.w13.shape[1] == 2 * 16  # rank 0's gate and up rows of every expert
    _assert_transformers_greedy(_greedy_batch(runner, prompt_ids), hf, prompt_ids)


# ---- the Triton path, interpreted ---------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_triton_fused_moe_gives_transformers_tokens(
    name, monkeypatch, make_runner, hf_model, prompt_ids
):
    """Every kernel on the Triton path (the interpreter here): batched, chunked prefill."""
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    runner = make_runner(name, block_size=8, num_blocks=32)
    prompts = prompt_ids[:2]
    seqs = [GreedySeq(p, 3) for p in prompts]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=8)
    for seq, prompt in zip(seqs, prompts, strict=True):
        tokens, logits = hf_greedy(hf_model(name), prompt, 3)
        assert seq.output == tokens
        for ours, ref in zip(seq.logits, logits, strict=True):
            assert (ours - ref).abs().max().item() < 1e-4
