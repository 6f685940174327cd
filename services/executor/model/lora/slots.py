"""The device slot table of multi-LoRA serving: ``max_loras`` slots, each holding one adapter's
weights in every projection, filled on demand from the adapters registered in host memory.

A forward names its rows' adapters by id (0: the base model); :meth:`LoRASlots.activate` puts
each into a slot (least recently used slot out, never one this forward needs) and sets the
rows-to-slots map every projection reads. The scheduler never runs more distinct adapters at
once than there are slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from services.executor.model.layers.linear import Linear
from services.executor.model.lora.adapter import (
    NUM_PARTS,
    LoRAAdapter,
    LoRAModule,
    part_sizes,
    read_adapter,
)
from services.executor.model.lora.layer import (
    LoRABatched,
    LoRAContext,
    LoRAGroup,
    LoRAMapping,
    LoRAProjection,
)
from services.executor.model.models import DecoderLM
from services.executor.model.workers import LORA_FORGET, LORA_REGISTER

__all__ = ["LoRASlots"]


class LoRASlots:
    """The slot table of one model (one rank), and the adapters it may load."""

    def __init__(self, model: DecoderLM, max_loras: int, max_lora_rank: int) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.model = model
        self.num_slots, self.max_rank = max_loras, max_lora_rank
        self.context = LoRAContext()
        self.device = next(model.parameters()).device
        #: (layer, our projection) -> its slot table (this rank's shard of it)
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        for i, layer in enumerate(model.layers):
            for name, num_parts in NUM_PARTS.items():
                module = _submodule(layer, name)
                if not isinstance(module, Linear):
                    continue  # a mixture of experts has no dense MLP projections
                projection = LoRAProjection(
                    self.context,
                    max_loras,
                    num_parts,
                    max_lora_rank,
                    module.in_features,
                    module.out_features,
                    model.dtype,
                    self.device,
                )
                module.lora = projection
                self.projections[(i, name)] = projection
        self.adapters: dict[int, LoRAAdapter] = {}
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free = list(range(max_loras))
        #: Rank 0 of a tensor-parallel model: tells the other ranks what it registers and
        #: forgets (``(kind, adapter id, path)``; see ``workers.LoRAHeader``).
        self.broadcast: Callable[[int, int, str], None] | None = None

    def read(self, path: str) -> LoRAAdapter:
        """The adapter at ``path``, read and checked for this model (any thread);
        :class:`~services.executor.model.errors.ModelLoadError` naming what does not fit."""
        m = self.model
        return read_adapter(path, m.config, m.dtype, self.max_rank, m.checkpoint_name)

    def register(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Make ``adapter`` loadable under ``adapter_id`` (> 0, never reused for other
        content)."""
        if adapter_id <= 0:
            raise ValueError("adapter ids are positive (0 is the base model)")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} > max_lora_rank {self.max_rank}")
        missing = [key for key in adapter.modules if key not in self.projections]
        if missing:
            raise ValueError(f"the model has no LoRA projection {missing[0]}")
        if self.broadcast is not None:
            self.broadcast(LORA_REGISTER, adapter_id, adapter.path)
        self.adapters[adapter_id] = adapter

    def forget(self, adapter_id: int) -> None:
        """Drop ``adapter_id``: its host copy and its slot, if it holds one."""
        if self.broadcast is not None and adapter_id in self.adapters:
            self.broadcast(LORA_FORGET, adapter_id, "")
        self.adapters.pop(adapter_id, None)
        slot = self._slots.pop(adapter_id, None)
        if slot is not None:
            for projection in self.projections.values():
                projection.clear(slot)
            self._free.append(slot)

    def reset(self) -> None:
        """Forget every adapter (a new registry starts over on a model already loaded)."""
        for adapter_id in [*self.adapters, *self._slots]:
            self.forget(adapter_id)

    def activate(self, row_adapters: np.ndarray) -> LoRAMapping:
        """Put the adapters of ``row_adapters`` (``[T]``, an adapter id per token row, 0 for
        the base model) in slots and make them the mapping of the next forward (rows of an
        adapter no longer registered apply none)."""
        ids = np.unique(row_adapters)
        # An adapter forgotten since the batch was built served only sequences that ended in
        # between (a request holds its adapter while it lives): their rows write nothing.
        wanted = [int(i) for i in ids if i != 0 and (i in self.adapters or i in self._slots)]
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters in one forward; max_loras={self.num_slots}")
        for adapter_id in wanted:
            if adapter_id in self._slots:
                self._slots.move_to_end(adapter_id)
        for adapter_id in wanted:
            if adapter_id not in self._slots:
                self._load(adapter_id, keep=wanted)
        mapping = self._mapping(row_adapters, wanted)
        self.context.mapping = mapping
        return mapping

    def clear_mapping(self) -> None:
        self.context.mapping = LoRAMapping()

    def _load(self, adapter_id: int, keep: Sequence[int]) -> None:
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            raise KeyError(f"adapter {adapter_id} is not registered")
        if self._free:
            slot = self._free.pop(0)  # lowest first: ids loaded in order get slots in order
        else:
            victim = next(i for i in self._slots if i not in keep)
            slot = self._slots.pop(victim)
        for key, projection in self.projections.items():
            projection.clear(slot)
            for module in adapter.modules.get(key, ()):
                self._place(projection, slot, key[1], module)
        self._slots[adapter_id] = slot

    def _place(self, projection: LoRAProjection, slot: int, name: str, module: LoRAModule) -> None:
        """Copy this rank's shard of ``module`` into ``slot``: ``A`` whole and the rows of
        ``B`` this rank's output holds (column-parallel q/k/v, gate/up), or the columns of
        ``A`` of this rank's input and ``B`` whole (row-parallel o, down; their partial
        sums meet in the layer's all-reduce)."""
        r, col = module.rank, module.parts[0] * self.max_rank  # its piece of the rank axis
        a_dst = projection.a[slot, col : col + r]
        b_dst = projection.b[slot, :, col : col + r]
        s, c = self.model.shard, self.model.config
        if name in ("self_attn.o_proj", "mlp.down_proj"):
            if name == "self_attn.o_proj":
                start, n = s.q_head_start * c.head_dim, s.num_heads * c.head_dim
            else:
                start, n = s.intermediate_start, s.num_real_intermediate
            a_dst[:, :n].copy_(module.a[:, start : start + n])
            b_dst.copy_(module.b)
            return
        a_dst.copy_(module.a)
        sizes = part_sizes(name, c)
        first = 0  # where each part's rows start in the module's B (Phi-3: several parts)
        for part in module.parts:
            offset, rows, start, _ = self.model._fused_part(name, part)
            b_dst[offset : offset + rows].copy_(module.b[first + start : first + start + rows])
            first += sizes[part]

    def _mapping(self, row_adapters: np.ndarray, wanted: list[int]) -> LoRAMapping:
        if not wanted:
            return LoRAMapping()
        device, num = self.device, len(wanted)
        if device.type == "cuda":  # the kernels group the rows themselves
            slots = np.full(len(row_adapters), -1, dtype=np.int32)
            for adapter_id in wanted:
                slots[row_adapters == adapter_id] = self._slots[adapter_id]
            token_slots = torch.from_numpy(slots).to(device, non_blocking=True)
            return LoRAMapping(token_slots=token_slots, num_adapters=num)
        # In row order (the scheduler groups each adapter's rows).
        rows_of = sorted((np.flatnonzero(row_adapters == i) for i in wanted), key=lambda r: r[0])
        used = [self._slots[int(row_adapters[r[0]])] for r in rows_of]
        flat = np.concatenate(rows_of)
        contiguous = int(flat[-1]) - int(flat[0]) + 1 == len(flat) and bool(
            np.all(np.diff(flat) == 1)
        )
        if num == 1 and contiguous:  # one adapter on one slice: two matmuls
            group = LoRAGroup(used[0], slice(int(flat[0]), int(flat[-1]) + 1))
            return LoRAMapping(group=group, num_adapters=1)
        # Else one batched pair over the slots in use.
        m = max(len(r) for r in rows_of)
        if used == list(range(used[0], used[0] + num)):
            slots_of: slice | torch.Tensor = slice(used[0], used[0] + num)
        else:
            slots_of = torch.tensor(used, device=device)
        equal = all(len(r) == m for r in rows_of)
        if equal and contiguous:
            batched = LoRABatched(slots_of, num, m, start=int(flat[0]))
            return LoRAMapping(batched=batched, num_adapters=num)
        gather = np.zeros((num, m), dtype=np.int64)
        for g, rows in enumerate(rows_of):
            gather[g, : len(rows)] = rows
        valid = None
        if not equal:
            valid = np.concatenate([g * m + np.arange(len(r)) for g, r in enumerate(rows_of)])
        batched = LoRABatched(
            slots_of,
            num,
            m,
            gather=torch.from_numpy(gather.reshape(-1)).to(device),
            valid=None if valid is None else torch.from_numpy(valid).to(device),
            dest=torch.from_numpy(flat).to(device),
        )
        return LoRAMapping(batched=batched, num_adapters=num)


def _submodule(layer: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None
