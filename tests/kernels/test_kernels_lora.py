"""The multi-LoRA ops (shrink ``x @ A[slot].T`` into fp32, expand ``y += s @ B[slot].T`` in
place, per row's slot, ``-1`` = no adapter): the grouping of rows by slot, the Triton
kernels against the torch reference under the interpreter in fp32 and fp16 here, and bf16
plus a CUDA-graph replay with new slots on a GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from pagedserve.kernels.lora_triton import (
    LoRAKernelConfig,
    lora_expand_triton,
    lora_shrink_triton,
    lora_token_groups,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMALL_TILES = LoRAKernelConfig(block_m=16, block_n=16, block_k=16)  # few interpreted programs

# (T, S, R, K, N, slot counts): counts[i] rows use slot i, the rest of the T rows slot -1,
# shuffled. Every shape is small for the interpreter.
CASES = {
    "uneven": (23, 4, 16, 48, 40, (10, 0, 3, 1)),  # slot 1 unused, 9 rows without adapter
    "decode": (1, 3, 8, 32, 24, (0, 1, 0)),  # one token
    "long-run": (41, 2, 8, 32, 48, (3, 35)),  # slot 1 spans three 16-row tiles
    "ragged": (19, 6, 16, 50, 37, (0, 7, 0, 0, 9, 0)),  # K, N past the tiles; idle slots
    "rank-24": (12, 3, 24, 40, 20, (4, 4, 4)),  # R pads to 32; expand reduces it in 2 steps
    "no-adapter": (7, 3, 16, 32, 32, (0, 0, 0)),  # every row -1
}


def _slots(t: int, counts: tuple[int, ...], seed: int) -> torch.Tensor:
    values = [slot for slot, c in enumerate(counts) for _ in range(c)]
    values += [-1] * (t - len(values))
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(seed))
    return torch.tensor(values, dtype=torch.int32)[perm].to(DEVICE)


def _inputs(
    t: int,
    num_slots: int,
    rank: int,
    k: int,
    n: int,
    counts: tuple[int, ...],
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """``x [T, K]``, ``a [S, R, K]``, ``b [S, N, R]``, ``s [T, R]`` fp32, ``y [T, N]``,
    ``token_slots [T]`` int32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(num_slots, rank, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, n, rank, generator=gen) / rank**0.5
    s = torch.randn(t, rank, generator=gen)  # nonzero on -1 rows too: they must be ignored
    y = torch.randn(t, n, generator=gen)
    return (
        x.to(dtype).to(DEVICE),
        a.to(dtype).to(DEVICE),
        b.to(dtype).to(DEVICE),
        s.to(DEVICE),
        y.to(dtype).to(DEVICE),
        _slots(t, counts, seed),
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def _check_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
    config: LoRAKernelConfig | None,
) -> None:
    expected = y.clone()
    lora_expand_ref(s, b, slots, expected)
    before = y.clone()
    lora_expand_triton(s, b, slots, y, config=config)
    _close(y, expected, dtype)
    none = slots < 0
    assert torch.equal(y[none], before[none])  # rows without adapter: never written


# ---- grouping -----------------------------------------------------------------------------


def test_groups_sort_rows_by_slot_stably_with_no_adapter_rows_last():
    slots = torch.tensor([2, -1, 0, 2, 3, -1, 0, 2], dtype=torch.int32)
    groups = lora_token_groups(slots, 5)  # slots 1 and 4 unused
    assert groups.sorted_ids.dtype == groups.counts.dtype == groups.starts.dtype == torch.int32
    assert groups.sorted_ids.tolist() == [2, 6, 0, 3, 7, 4, 1, 5]
    assert groups.counts.tolist() == [2, 0, 3, 1, 0]
    assert groups.starts.tolist() == [0, 2, 2, 5, 6]


def test_groups_of_int64_slots_and_of_an_empty_batch():
    groups = lora_token_groups(torch.tensor([1, 1, -1], dtype=torch.int64), 2)
    assert groups.counts.tolist() == [0, 2] and groups.sorted_ids.tolist() == [0, 1, 2]
    empty = lora_token_groups(torch.zeros(0, dtype=torch.int32), 3)
    assert empty.sorted_ids.numel() == 0 and empty.counts.tolist() == [0, 0, 0]


# ---- Triton under the interpreter ---------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_shrink_matches_the_reference(case, dtype):
    x, a, _, _, _, slots = _inputs(*CASES[case], dtype=dtype)
    out = lora_shrink_triton(x, a, slots, config=SMALL_TILES)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], a.shape[1])
    _close(out, lora_shrink_ref(x, a, slots), dtype)
    assert not out[slots < 0].any()  # rows without adapter: zero


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_expand_adds_into_y_like_the_reference(case, dtype):
    _, _, b, s, y, slots = _inputs(*CASES[case], dtype=dtype, seed=1)
    _check_expand(s, b, slots, y, dtype, SMALL_TILES)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_triton_shrink_split_over_k_adds_the_partial_sums(dtype):
    """``K = 80`` in 16-wide steps over 3 programs: 2, 2 and 1 steps, added atomically."""
    x, a, _, _, _, slots = _inputs(21, 3, 16, 80, 16, (9, 0, 5), dtype=dtype, seed=2)
    cfg = LoRAKernelConfig(block_m=16, block_n=16, block_k=16, split_k=3)
    _close(lora_shrink_triton(x, a, slots, config=cfg), lora_shrink_ref(x, a, slots), dtype)


@pytest.mark.parametrize("t", [5, 130], ids=["decode-tiles", "prefill-tiles"])
def test_triton_ops_with_their_default_tiles(t):
    """The shape-chosen tiles: 16-row tiles and split-K up to 128 rows, 64-row tiles past it;
    int64 slots."""
    x, a, b, _, y, slots = _inputs(t, 3, 8, 272, 72, (t // 3, 0, t // 2), torch.float32, seed=3)
    slots = slots.long()
    shrunk = lora_shrink_triton(x, a, slots)
    _close(shrunk, lora_shrink_ref(x, a, slots), torch.float32)
    _check_expand(shrunk, b, slots, y, torch.float32, None)


def test_groups_computed_once_serve_both_ops():
    x, a, b, _, y, slots = _inputs(*CASES["uneven"], dtype=torch.float32, seed=4)
    groups = lora_token_groups(slots, a.shape[0])
    shrunk = lora_shrink_triton(x, a, slots, groups=groups, config=SMALL_TILES)
    expected_y = y.clone()
    lora_expand_ref(lora_shrink_ref(x, a, slots), b, slots, expected_y)
    lora_expand_triton(shrunk, b, slots, y, groups=groups, config=SMALL_TILES)
    _close(y, expected_y, torch.float32)


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
    x, a, b, _, y, slots = _inputs(*CASES["uneven"], dtype=torch.float32, seed=5)
    with Recorder() as recorder:
        shrunk = lora_shrink_triton(x, a, slots, config=SMALL_TILES)
        lora_expand_triton(shrunk, b, slots, y, config=SMALL_TILES)
    assert "aten.sort" in recorder.ops or "aten.argsort" in recorder.ops  # it saw the grouping
    assert not recorder.ops & syncing


def test_empty_batch_and_empty_slot_table():
    x, a, b, s, y, slots = _inputs(*CASES["decode"], dtype=torch.float32)
    for shrink in (lora_shrink_triton, lora_shrink_ref):
        assert shrink(x[:0], a, slots[:0]).shape == (0, a.shape[1])
    y0 = y[:0].clone()
    for expand in (lora_expand_triton, lora_expand_ref):
        expand(s[:0], b, slots[:0], y0)
    none = torch.full_like(slots, -1)
    assert not lora_shrink_triton(x, a[:0], none).any()
    before = y.clone()
    lora_expand_triton(s, b[:0], none, y)
    assert torch.equal(y, before)


def test_shapes_that_break_the_contract_are_refused():
    x, a, b, s, y, slots = _inputs(*CASES["uneven"], dtype=torch.float32)
    for shrink in (lora_shrink_triton, lora_shrink_ref):
        with pytest.raises(ValueError, match="lora_shrink"):
            shrink(x[:, :-1], a, slots)
        with pytest.raises(ValueError, match="lora_shrink"):
            shrink(x, a.half(), slots)
        with pytest.raises(ValueError, match="token_slots"):
            shrink(x, a, slots[:-1])
    for expand in (lora_expand_triton, lora_expand_ref):
        with pytest.raises(ValueError, match="lora_expand"):
            expand(s.half(), b, slots, y)
        with pytest.raises(ValueError, match="lora_expand"):
            expand(s, b, slots, y[:, :-1])
        with pytest.raises(ValueError, match="token_slots"):
            expand(s, b, slots.float(), y)
    with pytest.raises(ValueError, match="power of two"):
        LoRAKernelConfig(block_m=8, block_n=16, block_k=16)


# ---- dispatch -----------------------------------------------------------------------------


def test_ops_dispatch_to_triton_when_forced(force_triton, monkeypatch):
    import pagedserve.kernels.lora_triton as lora

    calls: list[str] = []
    for name in ("lora_shrink_triton", "lora_expand_triton"):
        real = getattr(lora, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args, config=SMALL_TILES)

        monkeypatch.setattr(lora, name, spy)
    x, a, b, _, y, slots = _inputs(*CASES["uneven"], dtype=torch.float16, seed=6)
    expected_s = lora_shrink_ref(x, a, slots)
    expected_y = y.clone()
    lora_expand_ref(expected_s, b, slots, expected_y)
    shrunk = ops.lora_shrink(x, a, slots)
    ops.lora_expand(shrunk, b, slots, y)
    assert calls == ["lora_shrink_triton", "lora_expand_triton"]
    _close(shrunk, expected_s, torch.float16)
    _close(y, expected_y, torch.float16)


def test_ops_serve_cpu_tensors_with_the_reference(monkeypatch):
    import pagedserve.kernels.lora_triton as lora

    monkeypatch.delenv("PAGEDSERVE_FORCE_TRITON", raising=False)
    for name in ("lora_shrink_triton", "lora_expand_triton"):
        monkeypatch.setattr(lora, name, lambda *a, **k: pytest.fail("Triton on the CPU path"))
    x, a, b, _, y, slots = (
        t.cpu() for t in _inputs(64, 4, 16, 96, 80, (20, 0, 30, 5), torch.float32, seed=7)
    )
    shrunk = ops.lora_shrink(x, a, slots)
    assert torch.equal(shrunk, lora_shrink_ref(x, a, slots))
    expected_y = y.clone()
    lora_expand_ref(shrunk, b, slots, expected_y)
    ops.lora_expand(shrunk, b, slots, y)
    assert torch.equal(y, expected_y)


def test_reference_is_the_per_row_formula():
    """The oracle itself, against ``x[t] @ A[slot].T @ B[slot].T`` row by row."""
    x, a, b, _, y, slots = (t.cpu() for t in _inputs(*CASES["uneven"], dtype=torch.float64))
    shrunk = lora_shrink_ref(x.float(), a.float(), slots)
    out = y.float().clone()
    lora_expand_ref(shrunk, b.float(), slots, out)
    for t, slot in enumerate(slots.tolist()):
        want = y[t] if slot < 0 else y[t] + x[t] @ a[slot].T @ b[slot].T
        torch.testing.assert_close(out[t].double(), want, rtol=1e-5, atol=1e-5)


# ---- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("t", [1, 7, 256, 1000])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_gpu_lora_ops_match_the_reference(dtype, t, rank):
    counts = (t // 4, 0, t // 3, 1, t // 6, 0, 0, t // 5)  # 8 slots, 3 idle, some -1
    x, a, b, _, y, slots = _inputs(t, 8, rank, 1000, 1500, counts, dtype, seed=8)
    shrunk = ops.lora_shrink(x, a, slots)
    expected_s = lora_shrink_ref(x, a, slots)
    _close(shrunk, expected_s, dtype)
    expected_y = y.clone()
    lora_expand_ref(expected_s, b, slots, expected_y)
    before = y.clone()
    ops.lora_expand(shrunk, b, slots, y)
    _close(y, expected_y, dtype)
    assert torch.equal(y[slots < 0], before[slots < 0])


@pytest.mark.gpu
def test_gpu_lora_ops_never_sync_and_replay_in_a_cuda_graph_with_new_slots():
    dtype, t, num_slots = torch.bfloat16, 64, 4
    x, a, b, _, y, slots = _inputs(t, num_slots, 16, 512, 768, (32, 0, 0, 0), dtype, seed=9)
    base = y.clone()

    def step() -> torch.Tensor:
        shrunk = ops.lora_shrink(x, a, slots)
        ops.lora_expand(shrunk, b, slots, y)
        return shrunk

    step()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm the allocator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shrunk = step()
    # Replay with other slots: captured with 32 rows on slot 0 and 32 without adapter, now
    # slot 3 (idle at capture) spans three 16-row tiles, slot 1 one row, 10 rows without.
    x.copy_(_inputs(t, num_slots, 16, 512, 768, (0,), dtype, seed=11)[0])
    for counts in ((12, 1, 0, 41), (0, 0, 0, 0)):
        new_slots = _slots(t, counts, seed=10)
        slots.copy_(new_slots)  # in place: the graph reads this buffer
        y.copy_(base)
        graph.replay()
        torch.cuda.synchronize()
        expected_s = lora_shrink_ref(x, a, new_slots)
        _close(shrunk, expected_s, dtype)
        expected_y = base.clone()
        lora_expand_ref(expected_s, b, new_slots, expected_y)
        _close(y, expected_y, dtype)
        none = new_slots < 0
        assert torch.equal(y[none], base[none])
