"""Model families: one file each, a configuration of the shared ``layers/`` plus the map from
its checkpoint's weight names. A new family is a new file here and a line in
:data:`MODEL_CLASSES`."""

from __future__ import annotations

from services.executor.model.errors import UnsupportedModelError
from services.executor.model.models.gemma import GemmaLM
from services.executor.model.models.llama import DecoderLM

__all__ = ["MODEL_CLASSES", "DecoderLM", "GemmaLM", "model_class"]

#: HF architecture class name -> the class that implements it.
MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "LlamaForCausalLM": DecoderLM,
    "MistralForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,  # QK-norm: a layer option (ModelConfig.qk_norm)
    # A sparse mixture of experts in place of the MLP (ModelConfig.moe, layers/moe.py):
    "MixtralForCausalLM": DecoderLM,
    "Qwen3MoeForCausalLM": DecoderLM,
    "Phi3ForCausalLM": DecoderLM,  # its checkpoints store qkv_proj and gate_up_proj fused
    # Sandwich norms; (1 + w) gains, GeGLU, soft-capping and sliding layers are config:
    "Gemma2ForCausalLM": GemmaLM,
    "Gemma3ForCausalLM": GemmaLM,
    "Gemma3ForConditionalGeneration": GemmaLM,  # its language model; no vision tower
}
# Sequence classifiers: the same decoder, a score head for the LM head (ModelConfig.labels).
MODEL_CLASSES.update(
    {
        arch.replace("ForCausalLM", "ForSequenceClassification"): cls
        for arch, cls in list(MODEL_CLASSES.items())
        if arch.endswith("ForCausalLM") and arch != "Gemma3ForCausalLM"
    }
)


def model_class(architecture: str) -> type[DecoderLM]:
    """The implementation of ``architecture``; :class:`UnsupportedModelError` if none."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        ) from None
