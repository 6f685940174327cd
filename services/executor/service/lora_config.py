"""The executor's multi-LoRA flags (vLLM's names): ``--enable-lora``, ``--max-loras``,
``--max-lora-rank``, ``--max-cpu-loras`` and ``--lora-modules name=path ...``."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

__all__ = ["LoRAConfig", "LoRAModulePath"]


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter to load at start-up: served as ``name``, read from ``path``."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``."""
        if text.lstrip().startswith("{"):
            try:
                value = json.loads(text)
                return cls(str(value["name"]), str(value["path"]))
            except (ValueError, KeyError, TypeError):
                raise argparse.ArgumentTypeError(
                    f'{text!r}: expected {{"name": NAME, "path": DIR}}'
                ) from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
        return cls(name, path)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: off unless ``enable_lora``. ``max_loras`` adapters run in one
    batch (the device slots), up to rank ``max_lora_rank``; ``max_cpu_loras`` idle adapters
    stay in host memory (default: ``max_loras``); ``lora_modules`` load at start-up."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[LoRAModulePath, ...] = ()

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def validate(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ValueError("--max-loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})"
            )
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules: each adapter name once")

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("multi-LoRA serving")
        g.add_argument(
            "--enable-lora",
            action="store_true",
            help="serve LoRA adapters of the model: each request names its own (or none), and "
            "one batch mixes them",
        )
        g.add_argument(
            "--max-loras",
            type=int,
            default=cls.max_loras,
            help="distinct adapters running at once (their device slots); a request of one "
            "more waits for a slot",
        )
        g.add_argument(
            "--max-lora-rank",
            type=int,
            default=cls.max_lora_rank,
            help="the largest adapter rank served (the slots are sized for it)",
        )
        g.add_argument(
            "--max-cpu-loras",
            type=int,
            default=None,
            help="idle adapters kept in host memory, least recently used first out (default: "
            "--max-loras); the others are read again from disk when asked for",
        )
        g.add_argument(
            "--lora-modules",
            nargs="+",
            type=LoRAModulePath.parse,
            default=[],
            metavar="NAME=DIR",
            help='adapters to load at start-up: NAME=DIR or \'{"name": NAME, "path": DIR}\' '
            "(PEFT checkpoints)",
        )

    @classmethod
    def from_namespace(cls, ns: dict[str, object]) -> LoRAConfig:
        """Pop the LoRA values out of parsed arguments."""
        return cls(
            enable_lora=bool(ns.pop("enable_lora", False)),
            max_loras=ns.pop("max_loras", cls.max_loras),  # type: ignore[arg-type]
            max_lora_rank=ns.pop("max_lora_rank", cls.max_lora_rank),  # type: ignore[arg-type]
            max_cpu_loras=ns.pop("max_cpu_loras", None),  # type: ignore[arg-type]
            lora_modules=tuple(ns.pop("lora_modules", None) or ()),  # type: ignore[arg-type]
        )
