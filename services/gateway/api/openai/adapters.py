"""LoRA adapters over OpenAI's HTTP API, as vLLM serves them: a request names its adapter in
``model``; ``/v1/models`` lists the adapters with their ``parent`` (the base model) and
``root`` (the directory they were loaded from); ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change them at runtime (with ``--allow-runtime-lora-updating``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from services.gateway.api.openai.errors import HttpError
from services.gateway.core.adapters import AdapterService
from services.gateway.core.generation import GenerationError

__all__ = ["ModelNames", "add_adapter_routes"]


class LoadLoraAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's name: serve new files under a loaded name


class UnloadLoraAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


class ModelNames:
    """The names a request's ``model`` may give: the served model, or an adapter."""

    def __init__(self, model_name: str, adapters: AdapterService | None) -> None:
        self.model_name, self.adapters = model_name, adapters

    def lora_of(self, model: str | None) -> str:
        """The adapter ``model`` names ('' for the base model); 404 for an unknown model."""
        if model is None or model == self.model_name:
            return ""
        if self.adapters is not None and model in self.adapters.names():
            return model
        raise HttpError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (the base model's is the caller's)."""
        if self.adapters is None:
            return []
        return [self.card(name, created) for name in sorted(self.adapters.names())]

    def card(self, name: str, created: int) -> dict[str, Any]:
        parent = self.adapters.parent_of(name) if self.adapters is not None else None
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
            "root": parent,
            "parent": self.model_name,
        }


def add_adapter_routes(app: FastAPI, adapters: AdapterService) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterBody) -> PlainTextResponse:
        try:
            await adapters.load(body.lora_name, body.lora_path, body.load_inplace)
        except GenerationError as exc:
            raise HttpError.of(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterBody) -> PlainTextResponse:
        try:
            await adapters.unload(body.lora_name)
        except GenerationError as exc:
            raise HttpError.of(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
