"""A LoRA adapter read from a PEFT checkpoint (``adapter_config.json`` plus
``adapter_model.safetensors`` or ``adapter_model.bin``), checked against the base model it
will serve, and its content digest.

The adapter's weights are kept per projection of *our* model: HF's ``q_proj``, ``k_proj`` and
``v_proj`` are parts 0, 1 and 2 of our fused ``qkv_proj``, ``gate_proj`` and ``up_proj``
parts 0 and 1 of ``gate_up_proj`` (Phi-3's checkpoints fuse them already: one LoRA over
every part). Each module's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA,
``alpha_pattern`` applied) is folded into its ``B`` here, once.

Refused, naming the field: DoRA (``use_dora``), trained biases (``bias``, ``lora_bias``),
``modules_to_save``, ``fan_in_fan_out``, embedding or LM-head adapters, the experts or router
of a mixture of experts, a module the model does not have, a rank over ``max_lora_rank``, and
any tensor whose shape does not fit the base model (another base model).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from services.executor.model.config import ModelConfig
from services.executor.model.errors import ModelLoadError

__all__ = [
    "PROJECTIONS",
    "LoRAAdapter",
    "LoRAModule",
    "adapter_digest",
    "adapter_files",
    "read_adapter",
]

CONFIG_FILE = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

#: HF module (its last two names) -> (our projection, the parts of it the module covers).
PROJECTIONS: dict[str, tuple[str, tuple[int, ...]]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", (0,)),
    "self_attn.k_proj": ("self_attn.qkv_proj", (1,)),
    "self_attn.v_proj": ("self_attn.qkv_proj", (2,)),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", (0, 1, 2)),  # Phi-3
    "self_attn.o_proj": ("self_attn.o_proj", (0,)),
    "mlp.gate_proj": ("mlp.gate_up_proj", (0,)),
    "mlp.up_proj": ("mlp.gate_up_proj", (1,)),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", (0, 1)),  # Phi-3
    "mlp.down_proj": ("mlp.down_proj", (0,)),
}
#: Our projections with LoRA, and how many parts each has (its pieces in a slot).
NUM_PARTS: dict[str, int] = {
    "self_attn.qkv_proj": 3,
    "self_attn.o_proj": 1,
    "mlp.gate_up_proj": 2,
    "mlp.down_proj": 1,
}
_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight")
_MODULE = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)")


@dataclass(frozen=True)
class LoRAModule:
    """One HF module's low-rank update: ``y += x @ a.T @ b.T`` over the rows of ``parts`` of
    our projection (all of them, in order, when ``b`` covers several)."""

    parts: tuple[int, ...]
    a: Tensor  # [r, in]
    b: Tensor  # [out of the parts, r], the scaling folded in

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: its modules by layer and projection, on the CPU in the model dtype."""

    path: str
    digest: bytes  # sha256 of the config and weight files: the adapter's identity
    rank: int  # the largest of its modules' ranks
    #: (layer, our projection) -> the modules on it (one per part it adapts)
    modules: dict[tuple[int, str], list[LoRAModule]] = field(repr=False)


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """The config and weight files of the adapter at ``path``; :class:`ModelLoadError` naming
    what is missing."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"lora_path: {path} is not a directory")
    config = root / CONFIG_FILE
    if not config.is_file():
        raise ModelLoadError(f"lora_path: {path} has no {CONFIG_FILE}")
    for name in _WEIGHT_FILES:
        if (root / name).is_file():
            return config, root / name
    raise ModelLoadError(f"lora_path: {path} has neither {' nor '.join(_WEIGHT_FILES)}")


def adapter_digest(path: str | Path) -> bytes:
    """sha256 over the adapter's config and weight files (length-prefixed): equal digests mean
    the same weights and scalings, whatever the adapter is called."""
    h = hashlib.sha256(b"pagedserve-lora-v1")
    for file in adapter_files(path):
        h.update(file.name.encode() + b"\0" + file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.digest()


def read_adapter(
    path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    max_lora_rank: int,
    checkpoint_name: Any = None,
) -> LoRAAdapter:
    """Read and check the PEFT adapter at ``path`` for a model of ``config``.

    ``checkpoint_name`` maps a checkpoint tensor name to the model's (a family whose
    checkpoints nest the language model; None: the vision tower, skipped).
    """
    config_file, weight_file = adapter_files(path)
    digest = adapter_digest(path)
    try:
        peft = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"lora_path: {config_file} is not valid JSON: {exc}") from None
    if not isinstance(peft, dict):
        raise ModelLoadError(f"lora_path: {config_file} is not a JSON object")
    _check_peft_config(peft)
    tensors = _read_tensors(weight_file)
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ModelLoadError(
                f"lora_path: tensor {key!r} is not a LoRA A/B weight "
                "(embedding, DoRA or trained-bias tensors are not supported)"
            )
        module, which = match.group(1), match.group(2)
        pairs.setdefault(module, {})[which] = tensor
    modules: dict[tuple[int, str], list[LoRAModule]] = {}
    rank = 0
    for hf_module, pair in sorted(pairs.items()):
        name = checkpoint_name(f"{hf_module}.weight") if checkpoint_name else hf_module
        if name is None:
            continue  # a module of a part this model does not run (a vision tower)
        where = _placement(name.removesuffix(".weight").removeprefix("model."), config)
        if "lora_A" not in pair or "lora_B" not in pair:
            raise ModelLoadError(f"lora_path: module {hf_module!r} lacks lora_A or lora_B")
        layer, projection, parts = where
        module = _module(hf_module, pair["lora_A"], pair["lora_B"], parts, projection, config)
        module = _scaled(module, hf_module, peft, dtype)
        if module.rank > max_lora_rank:
            raise ModelLoadError(
                f"lora_path: module {hf_module!r} has rank {module.rank}, over "
                f"max_lora_rank={max_lora_rank}"
            )
        rank = max(rank, module.rank)
        modules.setdefault((layer, projection), []).append(module)
    if not modules:
        raise ModelLoadError(f"lora_path: {weight_file} holds no LoRA weights for this model")
    return LoRAAdapter(path=str(path), digest=digest, rank=rank, modules=modules)


def _check_peft_config(peft: dict[str, Any]) -> None:
    peft_type = str(peft.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ModelLoadError(f"peft_type: {peft_type} adapters are not supported (only LORA)")
    refused = {
        "use_dora": "DoRA is not supported",
        "lora_bias": "LoRA biases are not supported",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers) is not supported",
    }
    for key, why in refused.items():
        if peft.get(key):
            raise ModelLoadError(f"{key}: {why}")
    if peft.get("bias", "none") not in ("none", None):
        raise ModelLoadError(f"bias: {peft['bias']!r} trains the base model's biases; use 'none'")
    if peft.get("modules_to_save"):
        raise ModelLoadError(
            f"modules_to_save: {peft['modules_to_save']} replaces base modules; not supported"
        )
    if not isinstance(peft.get("r", 8), int) or not isinstance(
        peft.get("lora_alpha", 8), int | float
    ):
        raise ModelLoadError("r / lora_alpha: must be numbers")


def _read_tensors(file: Path) -> dict[str, Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt or truncated file: say which
        raise ModelLoadError(f"lora_path: cannot read {file}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ModelLoadError(f"lora_path: {file} does not hold a dict of tensors")
    return loaded


def _placement(name: str, config: ModelConfig) -> tuple[int, str, tuple[int, ...]]:
    """(layer, our projection, parts) of the adapted module ``name`` (model-relative)."""
    match = _MODULE.fullmatch(name)
    if match is None:
        raise ModelLoadError(
            f"target_modules: {name!r} is not a projection pagedserve adapts "
            "(q/k/v/o_proj, gate/up/down_proj; not embeddings or lm_head)"
        )
    layer = int(match.group(1))
    if layer >= config.num_layers:
        raise ModelLoadError(
            f"target_modules: {name!r}: the base model has {config.num_layers} layers"
        )
    key = f"{match.group(2)}.{match.group(3)}"
    moe = config.moe
    if match.group(2) == "mlp" and moe is not None and layer in moe.layers:
        raise ModelLoadError(
            f"target_modules: {name!r}: the experts and router of a mixture of experts "
            "take no adapter here (attention projections only)"
        )
    if key not in PROJECTIONS:
        raise ModelLoadError(f"target_modules: {name!r} is not a module of the base model")
    projection, parts = PROJECTIONS[key]
    return layer, projection, parts


def part_sizes(projection: str, config: ModelConfig) -> tuple[int, ...]:
    """Output rows of each part of our projection (whole model, not a rank's shard)."""
    if projection == "self_attn.qkv_proj":
        return (config.q_size, config.kv_size, config.kv_size)
    if projection == "mlp.gate_up_proj":
        return (config.intermediate_size, config.intermediate_size)
    return (config.hidden_size,)  # o_proj, down_proj


def in_features(projection: str, config: ModelConfig) -> int:
    """Input columns of our projection (whole model)."""
    if projection == "self_attn.o_proj":
        return config.q_size
    if projection == "mlp.down_proj":
        return config.intermediate_size
    return config.hidden_size


def _module(
    hf_module: str,
    a: Tensor,
    b: Tensor,
    parts: tuple[int, ...],
    projection: str,
    config: ModelConfig,
) -> LoRAModule:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ModelLoadError(
            f"lora_path: module {hf_module!r}: lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)} are not a rank-r pair"
        )
    sizes = part_sizes(projection, config)
    want = (sum(sizes[p] for p in parts), in_features(projection, config))
    if (b.shape[0], a.shape[1]) != want:
        raise ModelLoadError(
            f"lora_path: module {hf_module!r} maps {a.shape[1]} -> {b.shape[0]} features; the "
            f"base model's maps {want[1]} -> {want[0]} (an adapter of another base model?)"
        )
    return LoRAModule(parts, a, b)


def _scaled(
    module: LoRAModule, hf_module: str, peft: dict[str, Any], dtype: torch.dtype
) -> LoRAModule:
    """``module`` with its scaling folded into ``b``, both in ``dtype``."""
    r = module.rank
    alpha = float(_pattern(peft.get("alpha_pattern") or {}, hf_module, peft.get("lora_alpha", 8)))
    scaling = alpha / math.sqrt(r) if peft.get("use_rslora") else alpha / r
    b = (module.b.double() * scaling).to(dtype)
    return LoRAModule(module.parts, module.a.to(dtype).contiguous(), b.contiguous())


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern key that matches the end of the module's
    name (``(.*\\.)?key$``), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
