"""The fused mixture-of-experts op: the alignment of routed rows into expert blocks, the
Triton grouped GEMMs against the torch reference (under the interpreter in fp32 and fp16
here, bf16 and graph capture on a GPU), and the CPU path bit for bit against the
reference (and so against transformers' expert loop)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.cpu_moe import fused_moe_cpu
from pagedserve.kernels.fused_moe import MoEGemmConfig, fused_moe_triton, moe_align_block_size
from pagedserve.kernels.moe_reference import fused_moe_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}
SMALL_TILES = MoEGemmConfig(block_m=16, block_n=32, block_k=32)  # few interpreted programs

# (T, E, k, H, I, experts used): every shape is small for the interpreter. `used` limits
# the routing to a subset of the experts, so that some get no token.
CASES = {
    "one-token": (1, 4, 2, 32, 32, None),
    "idle-experts": (9, 8, 2, 32, 48, (1, 2, 6)),
    "ragged-dims": (13, 4, 2, 40, 24, None),  # H and I not multiples of the tiles
    "top3": (11, 6, 3, 32, 32, (0, 2, 3, 5)),
    "top1": (5, 3, 1, 32, 32, None),
}


def _inputs(
    t: int,
    e: int,
    k: int,
    h: int,
    i: int,
    used: tuple[int, ...] | None,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    pool = torch.tensor(used if used is not None else range(e))
    scores = torch.rand(t, len(pool), generator=gen)
    top = torch.topk(scores, k, dim=-1)
    weights = torch.softmax(top.values, dim=-1)
    ids = pool[top.indices]
    return (
        x.to(dtype).to(DEVICE),
        weights.to(dtype).to(DEVICE),
        ids.to(DEVICE),
        w13.to(dtype).to(DEVICE),
        w2.to(dtype).to(DEVICE),
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


# ---- alignment ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [4, 16])
def test_alignment_puts_every_assignment_once_in_blocks_of_one_expert(block_m):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3], [3, 0]])  # experts 2 and 4 idle
    num_experts, n = 6, ids.numel()
    sorted_ids, block_experts, num_padded = moe_align_block_size(ids, num_experts, block_m)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert num_padded.tolist() == [used]
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= used
    assert sorted_ids.dtype == block_experts.dtype == torch.int32
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # each assignment once
    assert (sorted_ids[used:] == n).all()  # past the used rows: padding only
    flat = ids.flatten()
    used_blocks = used // block_m
    experts = block_experts.tolist()
    assert experts[:used_blocks] == sorted(experts[:used_blocks])  # one run per expert
    assert experts[used_blocks:] == [-1] * (len(experts) - used_blocks)
    for b, expert in enumerate(experts[:used_blocks]):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        members = rows[rows < n]
        assert members.numel() > 0 and (flat[members.long()] == expert).all()
        assert members.tolist() == sorted(members.tolist())  # in order within an expert
    assert set(block_experts[block_experts >= 0].tolist()) == {0, 1, 3, 5}


def test_alignment_capacity_is_bounded_by_one_block_per_assignment():
    ids = torch.tensor([[7]])  # one token, top-1, 64 experts: one block, not 64
    sorted_ids, block_experts, num_padded = moe_align_block_size(ids, 64, 16)
    assert sorted_ids.numel() == 16 and block_experts.tolist() == [7]
    assert num_padded.tolist() == [16]


# ---- Triton under the interpreter ---------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_fused_moe_matches_the_reference(case, dtype):
    inputs = _inputs(*CASES[case], dtype=dtype)
    expected = fused_moe_reference(*inputs)
    _close(fused_moe_triton(*inputs, config=SMALL_TILES), expected, dtype)


def test_triton_fused_moe_with_the_prefill_tiles_and_grouped_launch():
    """Many rows per expert: the default config picks 64-row blocks, 8 per launch group."""
    inputs = _inputs(40, 3, 2, 32, 32, None, torch.float32, seed=1)
    _close(fused_moe_triton(*inputs), fused_moe_reference(*inputs), torch.float32)


def test_ops_dispatch_to_triton_when_forced(force_triton, monkeypatch):
    import pagedserve.kernels.fused_moe as fused

    calls: list[int] = []
    real = fused.fused_moe_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs, config=SMALL_TILES)

    monkeypatch.setattr(fused, "fused_moe_triton", spy)
    inputs = _inputs(*CASES["one-token"], dtype=torch.float32)
    _close(ops.fused_moe(*inputs), fused_moe_reference(*inputs), torch.float32)
    assert calls == [1]


def test_triton_path_reads_nothing_back_on_the_host():
    """No op of the Triton path syncs a device to the host (what a CUDA graph capture
    forbids): every aten op it dispatches is recorded, and none reads a value back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    syncing = {"aten._local_scalar_dense", "aten.nonzero", "aten.unique", "aten._unique2"}
    syncing |= {"aten.bincount", "aten.masked_select", "aten.unique_consecutive"}
    inputs = _inputs(*CASES["idle-experts"], dtype=torch.float32)
    with Recorder() as recorder:
        fused_moe_triton(*inputs, config=SMALL_TILES)
    assert "aten.searchsorted" in recorder.ops  # the recorder saw the alignment
    assert not recorder.ops & syncing


def test_no_tokens_give_an_empty_result():
    x, w, ids, w13, w2 = _inputs(*CASES["one-token"], dtype=torch.float32)
    for fn in (fused_moe_triton, fused_moe_cpu, fused_moe_reference):
        out = fn(x[:0], w[:0], ids[:0], w13, w2)
        assert out.shape == (0, x.shape[1]) and out.dtype == x.dtype


# ---- the CPU path -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_path_is_bit_identical_to_the_reference(case, dtype):
    inputs = [t.cpu() for t in _inputs(*CASES[case], dtype=dtype, seed=2)]
    assert torch.equal(fused_moe_cpu(*inputs), fused_moe_reference(*inputs))


def test_cpu_path_is_what_ops_serves_for_cpu_tensors(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_FORCE_TRITON", raising=False)
    inputs = [t.cpu() for t in _inputs(64, 8, 2, 64, 96, None, torch.float32, seed=3)]
    assert torch.equal(ops.fused_moe(*inputs), fused_moe_reference(*inputs))


def test_shapes_that_break_the_contract_are_refused():
    x, w, ids, w13, w2 = (t.cpu() for t in _inputs(*CASES["top1"], dtype=torch.float32))
    with pytest.raises(ValueError, match="fused_moe"):
        fused_moe_cpu(x, w, ids, w13, w2[:, :, :-1])
    with pytest.raises(ValueError, match="fused_moe"):
        fused_moe_cpu(x, w, ids.float(), w13, w2)


# ---- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("t", [1, 7, 256, 1000])
def test_gpu_fused_moe_matches_the_reference(dtype, t):
    inputs = _inputs(t, 8, 2, 256, 384, None, dtype, seed=4)
    _close(ops.fused_moe(*inputs), fused_moe_reference(*inputs), dtype)


@pytest.mark.gpu
def test_gpu_fused_moe_never_syncs_and_replays_in_a_cuda_graph():
    x, w, ids, w13, w2 = _inputs(16, 8, 2, 128, 256, None, torch.bfloat16, seed=5)
    ops.fused_moe(x, w, ids, w13, w2)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.fused_moe(x, w, ids, w13, w2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.fused_moe(x, w, ids, w13, w2)  # warm the allocator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = ops.fused_moe(x, w, ids, w13, w2)
    x2, w_2, ids2, _, _ = _inputs(16, 8, 2, 128, 256, None, torch.bfloat16, seed=6)
    x.copy_(x2)
    w.copy_(w_2)
    ids.copy_(ids2)
    graph.replay()
    _close(out, fused_moe_reference(x, w, ids, w13, w2), torch.bfloat16)
