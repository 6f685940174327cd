"""Tensor-parallel ranks: rank 0 (the executor process) launches ranks ``1 .. N-1`` as
processes (``torch.multiprocessing``, spawn) and drives them, one broadcast per operation.

Every rank joins two ``torch.distributed`` groups:

- the **default group** (NCCL on CUDA, one device per rank; gloo on the CPU) carries the
  model's collectives and each operation's payload, with ``--distributed-timeout``;
- a **control group** (gloo, CPU) carries the operation headers. A worker waits on it for
  as long as rank 0 is idle, so it has no practical timeout: a worker learns that rank 0
  died from the closed connection, or from its parent process disappearing.

An operation is a fixed-size int64 header broadcast on the control group, then its tensors
broadcast on the default group (never pickled objects):

- ``FORWARD``: the batch layout, ``max_query_len``, ``max_seq_len`` and the CUDA-graph
  size (0: eager), then the packed int64 and int32 batch buffers (see
  :class:`~.forward_batch.BatchLayout`);
- ``COPY_BLOCKS``: the number of pairs, then the ``[2, n]`` (src, dst) block ids;
- ``LORA``: an adapter registered (its path) or forgotten, or the adapter of each row of the
  next forward (see :class:`LoRAHeader`);
- ``SHUTDOWN``: nothing; the worker leaves its loop and exits 0.

A worker that dies is noticed by rank 0 at once: its next collective fails (gloo reports
the closed connection), and :meth:`WorkerGroup.watch` reports the process's exit even
while the executor is idle.
"""

from __future__ import annotations

import multiprocessing.connection
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from services.executor.model.cuda_graphs import GraphBackendName
from services.executor.model.parallel import DistComm, WorkerLost

if TYPE_CHECKING:
    from services.executor.model.runner_config import RunnerConfig

__all__ = [
    "HEADER_LEN",
    "LORA_FORGET",
    "LORA_MAP",
    "LORA_REGISTER",
    "CopyBlocksHeader",
    "ForwardHeader",
    "LoRAHeader",
    "Op",
    "OpHeader",
    "StepChannel",
    "WorkerGroup",
    "init_distributed",
    "rank_device",
]

log = structlog.get_logger(__name__)

# How long a failed join waits for a worker's exit (and its reason) before reporting its own.
_EXIT_REPORT_S = 5.0

HEADER_LEN = 8
_CONTROL_TIMEOUT = timedelta(days=365)  # a worker waits on rank 0 for as long as it idles


class Op(IntEnum):
    FORWARD = 1
    COPY_BLOCKS = 2
    SHUTDOWN = 3
    MOVE_BLOCKS = 4
    LORA = 5


class ForwardHeader(NamedTuple):
    """The fields of a ``FORWARD`` header: the packed batch's layout (see
    :class:`~.forward_batch.BatchLayout`), its longest query and context, and the CUDA-graph
    size it replays (0: eager)."""

    num_tokens: int
    num_seqs: int
    table_width: int
    num_logits: int
    max_query_len: int
    max_seq_len: int
    graph_size: int


class CopyBlocksHeader(NamedTuple):
    """The field of a ``COPY_BLOCKS`` header: how many (src, dst) pairs follow."""

    num_pairs: int


class MoveBlocksHeader(NamedTuple):
    """The fields of a ``MOVE_BLOCKS`` header: how many pairs of each kind of the tiers' moves
    follow, in one ``[n, 2]`` tensor (offloads, onboards, spills, loads, stores; see
    :mod:`.host_kv`). Every rank moves its own shard of the blocks between its own tiers."""

    num_offloads: int
    num_onboards: int
    num_spills: int
    num_loads: int
    num_stores: int


class LoRAHeader(NamedTuple):
    """The fields of a ``LORA`` header (multi-LoRA serving, every rank its shard of the
    slots): ``kind`` 1 registers adapter ``adapter_id`` read from the path that follows
    (``length`` UTF-8 bytes), 2 forgets it, 3 maps the next forward's rows to adapters (the
    ``length`` int64 adapter ids that follow; 0: no row uses one)."""

    kind: int
    adapter_id: int
    length: int


LORA_REGISTER, LORA_FORGET, LORA_MAP = 1, 2, 3

_Header = ForwardHeader | CopyBlocksHeader | MoveBlocksHeader | LoRAHeader
OpHeader = _Header | None
_HEADER_TYPES: dict[Op, type[_Header] | None] = {
    Op.FORWARD: ForwardHeader,
    Op.COPY_BLOCKS: CopyBlocksHeader,
    Op.SHUTDOWN: None,
    Op.MOVE_BLOCKS: MoveBlocksHeader,
    Op.LORA: LoRAHeader,
}
assert max(len(t._fields) for t in _HEADER_TYPES.values() if t) < HEADER_LEN


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA (one GPU per rank), else ``device``."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> Any:
    """Join the default group and the control group; returns the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


class StepChannel:
    """The operation stream from rank 0 to the other ranks (see the module docstring)."""

    def __init__(self, control: Any, rank: int) -> None:
        self.control = control
        self.rank = rank

    def send(self, op: Op, fields: OpHeader = None, payload: Sequence[Tensor] = ()) -> None:
        """Rank 0: broadcast one operation. Raises :class:`WorkerLost` when a rank is gone."""
        expected = _HEADER_TYPES[op]
        if (fields is None) != (expected is None) or (
            expected is not None and not isinstance(fields, expected)
        ):
            raise TypeError(f"{op.name} takes a {expected and expected.__name__} header")
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = int(op)
        if fields is not None:
            header[1 : 1 + len(fields)] = torch.tensor(list(fields), dtype=torch.int64)
        try:
            dist.broadcast(header, 0, group=self.control)
            for tensor in payload:
                dist.broadcast(tensor, 0)
        except RuntimeError as exc:
            raise WorkerLost(f"broadcast of {op.name} failed: {exc}") from exc

    def recv_header(self) -> tuple[Op, OpHeader]:
        """Ranks > 0: wait for the next operation; returns it and its header."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            dist.broadcast(header, 0, group=self.control)
        except RuntimeError as exc:
            raise WorkerLost(f"rank {self.rank} lost rank 0: {exc}") from exc
        values = header.tolist()
        op = Op(values[0])
        kind = _HEADER_TYPES[op]
        return op, None if kind is None else kind(*values[1 : 1 + len(kind._fields)])

    def recv_payload(self, tensors: Sequence[Tensor]) -> None:
        """Ranks > 0: receive the operation's tensors into ``tensors`` (shapes from the
        header)."""
        try:
            for tensor in tensors:
                dist.broadcast(tensor, 0)
        except RuntimeError as exc:
            raise WorkerLost(f"rank {self.rank} lost rank 0: {exc}") from exc


class WorkerGroup:
    """Rank 0's handle on ranks ``1 .. N-1``: their processes, the channel that drives them,
    and the communicator of the model's collectives."""

    def __init__(
        self,
        processes: list[Any],
        channel: StepChannel | None,
        comm: DistComm | None,
        errors: Any,
    ) -> None:
        self.processes = processes
        self.channel: StepChannel = channel  # type: ignore[assignment]  # set by launch
        self.comm: DistComm = comm  # type: ignore[assignment]
        self._errors = errors
        self._errors_lock = threading.Lock()
        self._closing = False
        self.lost: WorkerLost | None = None
        # Whether the workers wait for rank 0's next header: false until rank 0 has built its
        # shard (the workers may be in a start-up collective) and while an operation runs
        # (they may be in its collectives). Only then can SHUTDOWN be broadcast safely.
        self.idle = False

    @property
    def size(self) -> int:
        return len(self.processes) + 1

    @classmethod
    def launch(
        cls,
        config: RunnerConfig,
        device: torch.device,
        target: Callable[..., None],
        graph_backend: GraphBackendName | None = None,
    ) -> WorkerGroup:
        """Start the workers of ``config.tensor_parallel_size`` ranks and join their groups
        as rank 0 (``device`` is rank 0's; ``graph_backend`` as rank 0's, see
        ``build_runner``). Each worker process runs ``target(config, rank, init_method,
        errors, graph_backend)``, a module-level function (spawned, so importable).
        Raises :class:`WorkerLost` if a worker exits before
        joining, or they cannot join within ``--distributed-timeout``."""
        size = config.tensor_parallel_size
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        processes = [
            ctx.Process(
                target=target,
                args=(config, rank, init_method, errors, graph_backend),
                name=f"pagedserve-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        t0 = time.perf_counter()
        for p in processes:
            p.start()
        group = cls(processes, None, None, errors)
        try:
            control = group._join(init_method, device, config.distributed_timeout)
        except BaseException:
            group._kill()
            if dist.is_initialized():  # a join that failed half-way: a later one may succeed
                dist.destroy_process_group()
            raise
        log.info(
            "tensor_parallel_started",
            size=size,
            init_method=init_method,
            backend=dist.get_backend(),
            seconds=round(time.perf_counter() - t0, 2),
            worker_pids=[p.pid for p in processes],
        )
        group.channel, group.comm = StepChannel(control, 0), DistComm(device)
        return group

    def _join(self, init_method: str, device: torch.device, timeout_s: float) -> Any:
        """Join the groups as rank 0, failing as soon as a worker exits before joining (a
        worker that cannot start would otherwise leave rank 0 waiting out the timeout)."""
        done = threading.Event()
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["control"] = init_distributed(0, self.size, init_method, device, timeout_s)
            except BaseException as exc:  # reported below, in the calling thread
                result["error"] = exc
            finally:
                done.set()

        threading.Thread(target=join, name="tp-join", daemon=True).start()
        while not done.wait(0.1):
            self.check()  # WorkerLost naming the rank and its reported error
        if "error" in result:
            # A worker that failed and exited while we were still joining makes the join fail
            # with "connection closed by peer": its own reason, reported as it exits, says why.
            deadline = time.monotonic() + _EXIT_REPORT_S
            while time.monotonic() < deadline and any(p.is_alive() for p in self.processes):
                self.check()
                time.sleep(0.05)
            self.check()
            raise WorkerLost(
                f"tensor-parallel ranks did not join {init_method}: {result['error']}"
            ) from result["error"]
        return result["control"]

    def send(self, op: Op, fields: OpHeader = None, payload: Sequence[Tensor] = ()) -> None:
        """Broadcast one operation to the workers; :class:`WorkerLost` if one is gone. The
        caller runs rank 0's part of the operation, then calls :meth:`done`; until then the
        workers are not idle (an operation that raised leaves them so for good)."""
        self.check()
        self.idle = False
        try:
            self.channel.send(op, fields, payload)
        except WorkerLost as exc:
            raise self._lost(str(exc)) from exc

    def done(self) -> None:
        """Rank 0 finished its part of the last operation (or its start-up): the workers
        wait for the next header."""
        self.idle = True

    def check(self) -> None:
        """Raise :class:`WorkerLost` if a worker process has exited."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                raise self._lost(f"tensor-parallel rank {rank} exited with code {p.exitcode}")

    def _lost(self, message: str) -> WorkerLost:
        with self._errors_lock:  # the watcher and the engine thread may both get here
            reports = []
            while not self._errors.empty():
                reports.append(self._errors.get())
            if reports:
                message += f" ({'; '.join(reports)})"
            self.lost = self.lost or WorkerLost(message)
            return self.lost

    def watch(self, on_lost: Callable[[WorkerLost], None]) -> None:
        """Call ``on_lost`` (from a watcher thread) as soon as any worker process exits,
        unless the group is being closed."""

        def run() -> None:
            ready = multiprocessing.connection.wait([p.sentinel for p in self.processes])
            for p in self.processes:
                if p.sentinel in ready:
                    p.join(2.0)  # the sentinel closes a moment before the exit is reaped
            if self._closing:
                return
            try:
                self.check()
            except WorkerLost as exc:
                log.error("tensor_parallel_worker_lost", error=str(exc))
                on_lost(exc)

        threading.Thread(target=run, name="tp-worker-watch", daemon=True).start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers: SHUTDOWN when they are idle and all alive; otherwise (a rank
        lost, an operation or the start-up interrupted, so a collective may be pending) kill
        them. Then leave the process groups."""
        if self._closing:
            return
        self._closing = True
        clean = self.idle and self.lost is None
        if clean:
            try:
                self.send(Op.SHUTDOWN)
            except WorkerLost:
                clean = False
        deadline = time.monotonic() + (timeout_s if clean else 0.0)
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        # With its peers gone, a gloo group is left safely; an NCCL one with a collective in
        # flight can hang its destruction, and the process is about to exit anyway.
        if dist.is_initialized() and (clean or dist.get_backend() == "gloo"):
            dist.destroy_process_group()
        log.info("tensor_parallel_stopped", exit_codes=[p.exitcode for p in self.processes])

    def _kill(self) -> None:
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
        for p in self.processes:
            p.join(2.0)
