"""Worker for ``test_kernels_large_index.py``: kernels on a cache past 2^31 elements.

Run in a subprocess because an int32 overflow in a kernel's address arithmetic turns
into a wild pointer, i.e. a segfault (interpreter) or an illegal address (CUDA) that
would kill the test process. Prints ``OK`` and the peak RSS on success.

Memory: one fp16 buffer of ``2^31 + 32Ki`` elements (4 GiB) is *allocated* with
``torch.empty`` and never filled; only the handful of blocks the test writes are ever
touched, so the OS commits a few pages (RSS stays far below 1 GiB on CPU). Its layout is
``[NB, 2, BS, Hkv, D]`` permuted to the executor's ``[L=1, 2, NB, BS, Hkv, D]``: block
ids near ``NB`` put K/V at element offsets above 2^31, and the key/value caches are
strided (non-contiguous) views, which the kernels must handle through their strides.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.copy_blocks import copy_blocks_triton
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.paged_attention_split_kv import paged_attention_split_kv_triton
from pagedserve.kernels.reshape_and_cache import reshape_and_cache_triton

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 16, 1, 16, 4
BLOCK_STRIDE = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM  # K and V payloads of a block: 512
NUM_BLOCKS = 2**31 // BLOCK_STRIDE + 64  # elements = 2^31 + 32768
FIRST_HIGH_BLOCK = NUM_BLOCKS - 16  # element offset (2^22 + 48) * 512 > 2^31


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    buf = torch.empty(
        NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=device
    )
    kv_cache = buf.permute(1, 0, 2, 3, 4).unsqueeze(0)  # [1, 2, NB, BS, Hkv, D]
    key_cache, value_cache = kv_cache[0, 0], kv_cache[0, 1]
    assert FIRST_HIGH_BLOCK * BLOCK_STRIDE > 2**31

    # Two sequences, (context 20, query 1) and (context 5, query 9), on high blocks.
    seqs = [(20, 1), (5, 9)]
    tables = [[NUM_BLOCKS - 1, FIRST_HIGH_BLOCK + 3], [FIRST_HIGH_BLOCK]]
    block_tables = torch.tensor([tables[0], [tables[1][0], 0]], dtype=torch.int32)
    # reshape_and_cache: write every context token's K/V (plus one padding token).
    slots = [
        tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for b, (c, q) in enumerate(seqs)
        for p in range(c + q)
    ]
    slots.insert(7, -1)
    key = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=device)
    value = torch.randn_like(key)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    for t, slot in enumerate(slots):
        if slot >= 0:
            blk, off = divmod(slot, BLOCK_SIZE)
            assert torch.equal(key_cache[blk, off], key[t]), f"K slot {slot}"
            assert torch.equal(value_cache[blk, off], value[t]), f"V slot {slot}"

    # paged attention, unified and split-KV, against the reference on the same views.
    q_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([c + q for c, q in seqs], dtype=torch.int32)
    query = torch.randn(int(q_lens.sum()), NUM_Q_HEADS, HEAD_DIM, dtype=torch.float16)
    args = (
        query.to(device),
        key_cache,
        value_cache,
        block_tables.to(device),
        query_start_loc.to(device),
        seq_lens.to(device),
        HEAD_DIM**-0.5,
    )
    expected = reference.paged_attention(*args).float().cpu()
    for out in (
        paged_attention_triton(*args, max_query_len=9),
        paged_attention_split_kv_triton(*args, num_splits=2),
    ):
        torch.testing.assert_close(out.float().cpu(), expected, atol=4e-3, rtol=4e-3)

    # copy_blocks between two high blocks.
    src = torch.tensor([NUM_BLOCKS - 1], device=device)
    dst = torch.tensor([FIRST_HIGH_BLOCK + 7], device=device)
    copy_blocks_triton(kv_cache, src, dst)
    assert torch.equal(key_cache[dst[0]], key_cache[src[0]])
    assert torch.equal(value_cache[dst[0]], value_cache[src[0]])

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"OK peak_rss_mib={peak_mib:.0f}")


if __name__ == "__main__":
    sys.exit(main())
