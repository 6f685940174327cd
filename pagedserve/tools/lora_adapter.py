"""Random LoRA adapters in PEFT's format, for tests and benchmarks.

``pagedserve make-tiny-model DIR --lora BASE`` writes one for the checkpoint at ``BASE``:
``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's ``save_pretrained``
writes them, with nonzero ``A`` and ``B`` (PEFT's ``init_lora_weights=False``), on the
attention and MLP projections of every decoder layer (attention only in a mixture of
experts, even in its dense layers; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as they
are).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig

__all__ = ["DEFAULT_TARGETS", "adapter_modules", "write_random_adapter"]

#: PEFT's usual targets: every attention and MLP projection.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 stores q/k/v and gate/up fused: PEFT targets the fused modules.
_FUSED_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_FUSED_TARGETS |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def adapter_modules(
    base_dir: str | Path, targets: Sequence[str] = DEFAULT_TARGETS
) -> dict[str, tuple[int, int]]:
    """The decoder's linear modules of ``base_dir`` a LoRA on ``targets`` adapts, by HF module
    name, with their (in, out) features (no weights are read)."""
    config = AutoConfig.from_pretrained(str(base_dir))
    arch = (config.architectures or ["LlamaForCausalLM"])[0]
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    wanted = set(targets)
    if getattr(config, "model_type", "") == "phi3":
        wanted = {_FUSED_TARGETS.get(t, t) for t in wanted}
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        # A mixture of experts: attention only (PEFT maps MLP names of MoE checkpoints onto
        # their fused experts, which pagedserve does not adapt).
        wanted -= {"gate_proj", "up_proj", "down_proj"}
    pattern = re.compile(r"(.*\.)?layers\.\d+\.(self_attn|mlp)\.(\w+_proj)")
    modules: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        match = pattern.fullmatch(name)
        if match is None or "vision" in name or match.group(3) not in wanted:
            continue
        if isinstance(module, torch.nn.Linear):
            modules[name] = (module.in_features, module.out_features)
    return modules


def write_random_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    scale: float = 0.5,
) -> Path:
    """Write a random PEFT LoRA adapter for the checkpoint at ``base_dir`` to ``out_dir``.

    ``A`` has unit-variance rows over its input (std ``1/sqrt(in)``), ``B`` std
    ``scale / sqrt(rank)``: the update is of the order of ``scale`` times the layer's input,
    enough to change a tiny model's greedy tokens. Returns ``out_dir``.
    """
    modules = adapter_modules(base_dir, targets)
    if not modules:
        raise ValueError(f"{base_dir} has no module among {list(targets)}")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (fan_in, fan_out) in sorted(modules.items()):
        a = torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)
        b = torch.randn(fan_out, rank, generator=generator) * (scale / math.sqrt(rank))
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    short = sorted({name.rsplit(".", 1)[1] for name in modules})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": False,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        # A regex (PEFT full-matches it): the decoder's projections only, never a vision tower's.
        "target_modules": rf"(?!.*vision).*layers\.\d+\.(self_attn|mlp)\.({'|'.join(short)})",
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
