"""Starting the model side: :func:`build_runner` loads the model, sizes and allocates the
KV cache and captures the decode graphs, on every rank; :func:`worker_main` is the entry
point of tensor-parallel ranks ``1 .. N-1``, which rank 0 launches through
:class:`~.workers.WorkerGroup`.

Import order: ``workers`` (processes, channels) <- ``runner`` (the runner) <- this module,
so a worker process imports the runner without the runner importing it back.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from services.common.gc_policy import freeze_startup_heap
from services.common.logging import configure_logging
from services.common.malloc_policy import keep_large_blocks
from services.executor.model.cpu_threads import StepThreads
from services.executor.model.cuda_graphs import (
    CudaGraphBackend,
    EagerGraphBackend,
    GraphBackendName,
    graph_output_bytes,
    graph_rows,
)
from services.executor.model.disk_kv import DiskKVStore
from services.executor.model.draft import draft_bytes_per_block, draft_runner, load_draft
from services.executor.model.eagle import (
    Eagle3Head,
    Eagle3Runner,
    eagle3_bytes_per_block,
    load_eagle3,
)
from services.executor.model.errors import ModelLoadError
from services.executor.model.host_kv import HostKVCache
from services.executor.model.kv_cache import (
    allocate_kv_cache,
    kv_cache_torch_dtype,
    size_kv_cache,
)
from services.executor.model.kv_calibration import (
    CALIBRATION_TOKENS,
    calculate_kv_scales,
    calibration_tokens,
)
from services.executor.model.kv_layout import plan_kv_layout
from services.executor.model.loader import load_model, read_model_config, resolve_device
from services.executor.model.lora.slots import LoRASlots
from services.executor.model.models import DecoderLM
from services.executor.model.parallel import Comm, DistComm, ShardPlan, SingleComm
from services.executor.model.prepack import prepack_model
from services.executor.model.quantization import quantize_model
from services.executor.model.runner import ModelRunner
from services.executor.model.runner_config import RunnerConfig
from services.executor.model.workers import StepChannel, WorkerGroup, init_distributed, rank_device

__all__ = ["build_runner", "worker_main"]

log = structlog.get_logger(__name__)


def build_runner(
    config: RunnerConfig,
    *,
    comm: Comm | None = None,
    graph_backend: GraphBackendName | None = None,
) -> ModelRunner:
    """The one way to build a runner: load ``config.model`` on its device and dtype, size
    the KV cache (:func:`~.kv_cache.size_kv_cache`), allocate it, and on CUDA capture the
    decode graphs (unless ``enforce_eager``). Loading errors are ``ModelLoadError``; a cache
    too small for one full sequence is ``ValueError``.

    With ``tensor_parallel_size`` N > 1 this starts ranks 1..N-1 (which call this with their
    ``comm``) and builds rank 0's shard; every rank runs the same steps, in step.

    ``graph_backend``: ``"cuda"`` (the default on CUDA) or ``"eager"``, the replay stand-in
    of :mod:`.cuda_graphs`, which tests use to run the graph path on the CPU (on every
    rank); neither under ``enforce_eager``.
    """
    device = resolve_device(config.device)
    size = config.tensor_parallel_size
    workers = None
    if comm is None and size > 1:
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ModelLoadError(
                f"--tensor-parallel-size={size} needs {size} GPUs (one per rank), "
                f"{torch.cuda.device_count()} visible"
            )
        # The split is checked before any rank starts: a model that cannot be sharded is a
        # configuration error, raised here at once rather than raced by the ranks.
        ShardPlan.of(read_model_config(config.model, max_model_len=config.max_model_len), 0, size)
        workers = WorkerGroup.launch(config, rank_device(device, 0), worker_main, graph_backend)
        comm = workers.comm
    try:
        runner = _build(config, device, comm or SingleComm(), workers, graph_backend)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    if workers is not None:
        workers.done()  # every rank finished its start-up collectives
    return runner


def _build(
    config: RunnerConfig,
    device: torch.device,
    comm: Comm,
    workers: WorkerGroup | None,
    graph_backend: GraphBackendName | None,
) -> ModelRunner:
    if comm.size > 1:
        device = rank_device(device, comm.rank)
    if device.type == "cpu":
        keep_large_blocks()  # the forward's large temporaries reuse heap memory
        # The ranks share the host's cores: oversubscribed, every collective waits on the
        # slowest rank.
        threads = config.torch_threads(comm.size)
        if threads is not None:
            torch.set_num_threads(threads)
    model = load_model(
        config.model,
        dtype=config.dtype,
        device=device,
        max_model_len=config.max_model_len,
        shard=lambda mc: ShardPlan.of(mc, comm.rank, comm.size),
        comm=comm,
    )
    num_params = sum(p.numel() for p in model.parameters())  # this rank's, before packing
    if config.quantization is not None:  # before the slots and the cache take their memory
        quantize_model(model, config.quantization)
    prepack_model(model)  # (fp32 on the CPU: the other projections in oneDNN's layout)
    if config.calculate_kv_scales:  # over the load's own layout: every layer its own slot
        tokens = calibration_tokens(
            config.model,
            model.config.vocab_size,
            min(CALIBRATION_TOKENS, model.config.max_model_len),
        )
        model.kv_scales = calculate_kv_scales(model, tokens, config.block_size)
    model.use_kv_layout(plan_kv_layout(model.local_config, hybrid=config.cache.hybrid_kv_cache))
    if config.kv_cache_dtype != "auto":
        model.use_kv_cache_dtype(kv_cache_torch_dtype(config.kv_cache_dtype, model.config))
    graph_sizes = config.graph_sizes if graph_backend is not None or device.type == "cuda" else ()
    if config.pooling:
        model.pooling, graph_sizes = True, ()  # prompts only: nothing decodes
    # A draft model (speculative decoding) runs on the first rank, its cache of the same
    # blocks sized with the target's.
    draft = load_draft(config.draft_model, model) if config.draft_model and comm.rank == 0 else None
    # Or an EAGLE-3 head, which reads the target's features: its forwards keep them, the
    # graphs' too (as outputs of their own).
    head = (
        load_eagle3(config.eagle3_head, model, config.model)
        if config.eagle3_head and comm.rank == 0
        else None
    )
    # Multi-LoRA: every rank its shard of the slots, allocated before the cache is sized. The
    # rows' slots change every step: no graphs captured (yet).
    lora = LoRASlots(model, config.max_loras, config.max_lora_rank) if config.max_loras else None
    if lora is not None and graph_sizes:
        log.info("cuda_graphs_disabled", reason="lora adapters")
        graph_sizes = ()
    extra = draft_bytes_per_block(draft, config.block_size) if draft else 0
    extra += eagle3_bytes_per_block(head, config.block_size) if head else 0
    num_blocks = size_kv_cache(
        model,
        config.cache,
        max_num_batched_tokens=config.max_num_batched_tokens,
        graph_sizes=graph_sizes,
        graph_output_bytes=_graph_logits_bytes(graph_sizes, config, model, draft, head),
        extra_bytes_per_block=extra,
    )
    kv_cache = allocate_kv_cache(
        model.local_config,
        num_blocks,
        config.block_size,
        model.kv_cache_dtype,
        device,
        model.kv_layout.num_slots,
    )
    host = None
    if config.cache.host_tier_bytes:
        host = _host_tier(model, kv_cache, config.cache.host_tier_bytes)
        if config.cache.disk_tier_bytes:
            host.disk = _disk_tier(host, config.cache.disk_tier_bytes, config.cache.disk_tier_path)
        host.report_failures = comm.rank == 0  # (another rank's failure stops the executor)
    runner = ModelRunner(model, kv_cache, config.block_size, workers, host)
    if device.type == "cpu" and (small := config.decode_threads(comm.size)) is not None:
        runner.step_threads = StepThreads.for_model(torch.get_num_threads(), small, num_params)
    if lora is not None:
        runner.use_lora(lora)
    if draft is not None:
        runner.draft = draft_runner(draft, num_blocks, config.block_size)
    if head is not None:
        runner.eagle = Eagle3Runner(head, num_blocks, config.block_size)
    if graph_backend is None and device.type == "cuda":
        graph_backend = "cuda"
    if graph_backend is not None and graph_sizes:
        backend = CudaGraphBackend() if graph_backend == "cuda" else EagerGraphBackend()
        runner.capture(graph_sizes, backend, config.verify_query_len)  # every rank, in step
        if runner.draft is not None:
            # The draft's forwards: catching up (at most 1 + k tokens a sequence, as a
            # verification) and one token a sequence for each further draft.
            runner.draft.capture(graph_sizes, backend, config.verify_query_len)
        if runner.eagle is not None:  # its drafts after the first, one token a sequence
            runner.eagle.capture(graph_sizes, backend)
    return runner


def _graph_logits_bytes(
    sizes: tuple[int, ...],
    config: RunnerConfig,
    model: DecoderLM,
    draft: DecoderLM | None,
    head: Eagle3Head | None = None,
) -> int:
    """The outputs the CUDA graphs keep for good, beyond the largest decode forward's (which
    the KV-cache profile measures): every other graph's fp32 logits, decode and
    verification, the draft model's graphs' all, and an EAGLE-3 head's features, and its
    own graphs' logits and states (a row per sequence of each size)."""
    if not sizes:
        return 0
    verify = config.verify_query_len
    vocab = model.config.vocab_size
    out = graph_output_bytes(sizes, verify, vocab) - max(sizes) * vocab * 4
    if draft is not None:
        out += graph_output_bytes(sizes, verify, draft.config.vocab_size)
    if model.aux_layers:  # an EAGLE-3 head's features, a row per token of every graph
        width = len(model.aux_layers) * model.config.hidden_size * model.dtype.itemsize
        out += graph_rows(sizes, verify) * width
    if head is not None:
        mc = head.config.model
        out += sum(sizes) * (vocab * 4 + mc.hidden_size * head.dtype.itemsize)
    return out


def _host_tier(model: DecoderLM, kv_cache: torch.Tensor, budget: int) -> HostKVCache:
    """The host tier's slots in ``budget`` bytes (``--kv-offloading-size``, per rank: each
    holds its shard of every block, so every rank has as many slots). A slot holds a block
    in every slot of the cache: in a hybrid model, a block of one KV-cache group holds that
    group's layers, so one slot serves a block of any group."""
    per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    num_slots = budget // per_block
    if num_slots < 1:
        raise ModelLoadError(
            f"--kv-offloading-size: {budget} bytes hold no block of {per_block} bytes"
        )
    host = HostKVCache(kv_cache, num_slots)
    log.info("host_tier_allocated", num_slots=num_slots, bytes=host.bytes)
    return host


def _disk_tier(host: HostKVCache, budget: int, path: str | None) -> DiskKVStore:
    """The disk tier's slots in ``budget`` bytes (``--kv-offloading-disk-size``), in one file
    under ``path`` (``--kv-offloading-disk-path``)."""
    if not path:
        raise ModelLoadError("--kv-offloading-disk-size needs --kv-offloading-disk-path")
    per_slot = host.slots[0].numel() * host.slots.element_size()
    num_slots = budget // per_slot
    if num_slots < 1:
        raise ModelLoadError(
            f"--kv-offloading-disk-size: {budget} bytes hold no block of {per_slot} bytes"
        )
    try:
        disk = DiskKVStore(Path(path), host.slots, num_slots)
    except OSError as exc:
        raise ModelLoadError(f"--kv-offloading-disk-path {path}: {exc}") from None
    log.info("disk_tier_allocated", num_slots=num_slots, bytes=disk.bytes, path=path)
    return disk


def _exit_with_parent() -> None:
    """A worker must not outlive its executor (even one killed by SIGKILL, which closes
    no connection politely): a watcher thread exits the process when the parent is gone."""
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=run, name="tp-parent-watch", daemon=True).start()


def worker_main(
    config: RunnerConfig,
    rank: int,
    init_method: str,
    errors: Any,
    graph_backend: GraphBackendName | None = None,
) -> None:
    """Entry point of rank ``rank`` > 0: join the groups, load this rank's shard and size
    its KV cache in step with the other ranks, then run rank 0's operations until SHUTDOWN.
    Exits 0 after SHUTDOWN, 1 after any failure (reported to rank 0 on ``errors``)."""
    wlog = configure_logging("executor", config.log_level).bind(tp_rank=rank)
    # Rank 0 owns this process's life: a Ctrl-C or a SIGTERM sent to the executor's process
    # group must not kill it under a running step, so it leaves the group; rank 0 stops it
    # (SHUTDOWN, else SIGKILL), and it exits by itself when rank 0 is gone.
    os.setsid()
    _exit_with_parent()
    code = 0
    try:
        device = rank_device(resolve_device(config.device), rank)
        control = init_distributed(
            rank, config.tensor_parallel_size, init_method, device, config.distributed_timeout
        )
        runner = build_runner(config, comm=DistComm(device), graph_backend=graph_backend)
        wlog.info(
            "tensor_parallel_worker_ready",
            num_kv_blocks=runner.num_blocks,
            gc_frozen=freeze_startup_heap(),
        )
        runner.serve_rank(StepChannel(control, rank))
        wlog.info("tensor_parallel_worker_stopped")
    except BaseException as exc:  # report it to rank 0, then die: rank 0 cannot go on
        errors.put(f"rank {rank}: {exc!r}")
        wlog.error("tensor_parallel_worker_failed", error=repr(exc))
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
