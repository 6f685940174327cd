"""Loading a local Hugging Face checkpoint directory: config, weights, tokenizer.

Expected layout: ``config.json``; the weights as one ``model.safetensors`` or as shards
listed by ``model.safetensors.index.json``; the tokenizer files ``AutoTokenizer`` reads.
Nothing is ever fetched from a hub. Every failure is a :class:`ModelLoadError` (or its
subclass :class:`UnsupportedModelError`) whose message names the file, field or value.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.executor.model.config import ModelConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.models import DecoderLM, model_class
from services.executor.model.parallel import Comm, ShardPlan

__all__ = [
    "iter_checkpoint_slices",
    "iter_checkpoint_weights",
    "load_model",
    "load_tokenizer",
    "read_model_config",
    "resolve_device",
    "resolve_dtype",
]

log = structlog.get_logger(__name__)

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def read_model_config(model_dir: str | Path, *, max_model_len: int | None = None) -> ModelConfig:
    """Parse ``model_dir/config.json`` into a :class:`ModelConfig`."""
    path = Path(model_dir) / CONFIG_FILE
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a checkpoint directory needs {CONFIG_FILE}")
    return ModelConfig.from_hf_config(read_json_object(path), max_model_len=max_model_len)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a ModelLoadError naming the file if it is none."""
    try:
        obj: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return obj


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """``float32``/``float16``/``bfloat16`` (or a torch dtype, or an alias such as ``bf16``);
    ``auto`` takes the checkpoint's declared dtype, float32 when it declares none.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ModelLoadError(
                f"dtype {dtype} is not supported; use float32, float16 or bfloat16"
            )
        return dtype
    name = (config.torch_dtype or "float32") if dtype == "auto" else dtype
    if name not in _DTYPES:
        where = " (the checkpoint's torch_dtype)" if dtype == "auto" else ""
        raise ModelLoadError(
            f"dtype {name!r}{where} is not supported; use auto, float32, float16 or bfloat16"
        )
    return _DTYPES[name]


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu``, ``cuda[:n]``, or ``auto`` (CUDA when available, else the CPU); an
    unavailable CUDA device asked for by name is an error, not a fallback."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"device {device!r} is not a valid torch device") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} GPUs")
    elif dev.type != "cpu":
        raise ModelLoadError(f"device {device!r} is not supported; use cpu or cuda[:n]")
    return dev


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of the checkpoint, single or sharded."""
    model_dir = Path(model_dir)
    single = model_dir / SINGLE_WEIGHTS_FILE
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index with a weight_map") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing}")
        return files
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.safetensors")
    )
    hint = f" (found {others}; only {SINGLE_WEIGHTS_FILE} or an index is read)" if others else ""
    raise ModelLoadError(
        f"no weights in {model_dir}: neither {SINGLE_WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}{hint}"
    )


def iter_checkpoint_slices(model_dir: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(hf_name, safetensors slice)`` for every tensor of every weight file: nothing
    is read until the slice is indexed, so a shard reads only its own rows."""
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_slice(name)
        except (OSError, RuntimeError) as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors ({exc})") from exc


def iter_checkpoint_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor of every weight file, one at a time."""
    for name, weight in iter_checkpoint_slices(model_dir):
        yield name, weight[:]


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    shard: Callable[[ModelConfig], ShardPlan] | None = None,
    comm: Comm | None = None,
) -> DecoderLM:
    """Build the model on ``device`` in ``dtype`` and fill it from the checkpoint; under
    tensor parallelism, the shard that ``shard(config)`` names, reading only its slices."""
    config = read_model_config(model_dir, max_model_len=max_model_len)
    torch_dtype = resolve_dtype(dtype, config)
    dev = resolve_device(device)
    files = weight_files(model_dir)  # fail on missing weights before allocating anything
    plan = shard(config) if shard is not None else None
    model = model_class(config.architecture).empty(config, torch_dtype, dev, plan, comm)
    model.load_weights(iter_checkpoint_slices(model_dir))
    log.info(
        "model_loaded",
        model_dir=str(model_dir),
        architecture=config.architecture,
        dtype=str(torch_dtype),
        device=str(dev),
        num_weight_files=len(files),
        num_params=sum(p.numel() for p in model.parameters()),
        tensor_parallel_rank=model.shard.rank,
        tensor_parallel_size=model.shard.size,
    )
    return model


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer via ``AutoTokenizer``, from local files only."""
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
