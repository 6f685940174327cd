"""``pagedserve make-tiny-model DIR``: a tiny, random, real Hugging Face checkpoint.

The checkpoint is an ordinary HF directory (``config.json``, ``model.safetensors`` written by
``save_pretrained``, ``generation_config.json``, tokenizer files with a chat template) of one
of the families the executor serves (:data:`ARCHS`), small enough for CPU tests. Sliding
windows, when asked for, are short (``sliding_window``, e.g. 16) so that short prompts cross
them. Weights
are drawn from a seeded generator in a fixed order, so a given seed and size always give
the same files. Norm weights and biases are random too (not ones/zeros), so a loader that
forgot to load them would be caught, and the init scale is large enough for logits that
differ clearly between tokens: greedy decoding varies with the prompt instead of repeating
one token, and near-ties that would make exact-match tests flaky are rare.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SiglipVisionConfig,
)

from pagedserve.tools.eagle3_head import write_random_head
from pagedserve.tools.lora_adapter import write_random_adapter
from pagedserve.tools.tiny_tokenizer import (
    BOS,
    DEFAULT_VOCAB_SIZE,
    EOS,
    FAMILY_TEMPLATES,
    PAD,
    build_tokenizer,
    save_tokenizer,
)

__all__ = ["LLAMA_CHAT_TEMPLATE", "TinyModelSpec", "main", "write_tiny_model"]

Arch = Literal[
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3",
    "gemma3_mm",
]
RopeScaling = Literal["none", "linear", "llama3", "longrope"]
# (gemma3_mm: Gemma3ForConditionalGeneration, a tiny vision tower around the text model)
ARCHS: tuple[Arch, ...] = get_args(Arch)
_GEMMA_ARCHS = ("gemma2", "gemma3", "gemma3_mm")

#: The default (llama) checkpoint's chat template: the tiny tokenizer's role markers, and,
#: when a request has tools, Hermes-style tools, so that ``--tool-call-parser hermes`` reads
#: the calls: a ``<tools>`` block in the system turn, an assistant turn's calls as
#: ``<tool_call>`` blocks, a tool's result in a ``<tool_response>`` block. Each tool is one
#: signature line, ``name(param, ...): description``, not its JSON as Qwen's template writes
#: it: this tokenizer (768 tokens, learnt from prose) spends some 200 tokens on one tool's
#: JSON, and the test stacks run at max_model_len 512. A conversation without tools renders
#: exactly as the tokenizer's plain :data:`~pagedserve.tools.tiny_tokenizer.CHAT_TEMPLATE`.
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set loop_messages = messages %}"
    "{%- if tools %}"
    "{%- set system = '' %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\n\n' %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- endif %}"
    "{{- '<|system|>\n' + system + '# Tools\n<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- '\n' + fn.name + '(' }}"
    "{%- if fn.parameters is defined and fn.parameters.properties is defined %}"
    "{{- fn.parameters.properties | list | join(', ') }}"
    "{%- endif %}"
    "{{- ')' }}"
    "{%- if fn.description is defined and fn.description %}{{- ': ' + fn.description }}"
    "{%- endif %}"
    "{%- endfor %}"
    '{{- \'\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>\''
    " + eos_token + '\n' }}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|' + message['role'] + '|>\n' }}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- else %}"
    "{{- message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    '{{- \'<tool_call>\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments | tojson if call.arguments is not string else call.arguments }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- eos_token + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes and variants of a tiny checkpoint (defaults: ~100k parameters)."""

    arch: Arch = "llama"
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    tokenizer_vocab_size: int = DEFAULT_VOCAB_SIZE  # BPE target; the model takes the actual size
    extra_vocab: int = 0  # model rows past the tokenizer's (as real checkpoints often pad)
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling = "none"
    partial_rotary_factor: float = 1.0  # phi3 only (Phi-4-mini rotates 3/4 of each head)
    sliding_window: int | None = None  # None: no window (archs that can have one)
    sliding_window_pattern: int = 2  # gemma3: one global layer in every this many
    init_std: float = 0.25
    max_shard_size: str | None = None  # e.g. "100KB" for a sharded checkpoint
    num_labels: int = 0  # > 0: a sequence classifier (``*ForSequenceClassification``)


_CLASSIFIER_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2")


def write_tiny_model(
    model_dir: str | Path, arch: Arch = "llama", seed: int = 0, **sizes: Any
) -> Path:
    """Write a tiny checkpoint to ``model_dir`` (created if needed; files overwritten).

    ``sizes`` are the other :class:`TinyModelSpec` fields. Returns the directory.
    """
    spec = TinyModelSpec(arch=arch, seed=seed, **sizes)
    if spec.arch not in ARCHS:
        raise ValueError(f"arch {spec.arch!r} not in {ARCHS}")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec.tokenizer_vocab_size)
    special_ids: dict[str, int] = {}
    for tok in (BOS, EOS, PAD):
        token_id = tokenizer.token_to_id(tok)
        assert token_id is not None, f"the tokenizer lacks {tok}"
        special_ids[tok] = token_id
    config = _hf_config(spec, tokenizer.get_vocab_size() + spec.extra_vocab, special_ids)
    if spec.num_labels:
        if spec.arch not in _CLASSIFIER_ARCHS:
            raise ValueError(f"num_labels: {spec.arch} is written as a causal LM only")
        config.num_labels = spec.num_labels
        config.id2label = {i: f"label_{i}" for i in range(spec.num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, spec)
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[BOS], eos_token_id=special_ids[EOS], pad_token_id=special_ids[PAD]
    )
    save_kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(str(model_dir), **save_kwargs)
    save_tokenizer(
        tokenizer,
        model_dir,
        model_max_length=spec.max_position_embeddings,
        chat_template=LLAMA_CHAT_TEMPLATE if spec.arch == "llama" else FAMILY_TEMPLATES[spec.arch],
    )
    return model_dir


def _hf_config(
    spec: TinyModelSpec, vocab_size: int, special_ids: dict[str, int]
) -> PretrainedConfig:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if spec.rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    elif spec.rope_scaling == "longrope":
        # Phi-3 128k / Phi-4-mini style: per-frequency short and long factors, and an original
        # context of 64 so that short tests use one set or the other (see max_model_len).
        half = (
            int((spec.head_dim or spec.hidden_size // spec.num_heads) * spec.partial_rotary_factor)
            // 2
        )
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 64,
        }
    elif spec.rope_scaling == "llama3":
        # Llama 3.1's settings with the original context cut down so that, at head_dim 16,
        # some frequencies are scaled, some kept and some smoothed.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim or spec.hidden_size // spec.num_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "initializer_range": spec.init_std,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": special_ids[BOS],
        "eos_token_id": special_ids[EOS],
        "pad_token_id": special_ids[PAD],
    }
    window = spec.sliding_window
    # Qwen: the window, when set, on the layers from the second one on.
    qwen_window: dict[str, Any] = {
        "use_sliding_window": window is not None,
        "sliding_window": window,
    }
    if window is not None:
        qwen_window["max_window_layers"] = 1
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common, **qwen_window)
    if spec.arch == "qwen3":
        return Qwen3Config(**common, **qwen_window)
    if spec.arch == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint
        phi: dict[str, Any] = {"partial_rotary_factor": spec.partial_rotary_factor}
        if spec.rope_scaling == "longrope":
            phi["original_max_position_embeddings"] = 64
        return Phi3Config(**common, **phi, sliding_window=window)
    if spec.arch == "mixtral":  # 4 experts, 2 per token
        return MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=window
        )
    if spec.arch in _GEMMA_ARCHS:
        return _gemma_config(spec, common)
    if spec.arch == "qwen3_moe":  # 4 experts, 2 per token; layer 0 dense, the others sparse
        return Qwen3MoeConfig(
            **common,
            use_sliding_window=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate_size // 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )
    return MistralConfig(**common, sliding_window=window)


def _gemma_config(spec: TinyModelSpec, common: dict[str, Any]) -> PretrainedConfig:
    """Gemma 2 (soft-capping, alternating sliding and global layers) or Gemma 3 (QK-norm, one
    global layer in every two here, the sliding layers with their own RoPE base), with
    query_pre_attn_scalar != head_dim so that the attention scale is exercised."""
    window = spec.sliding_window or 16
    gemma = {
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24,
        "sliding_window": window,
        "attention_bias": False,
    }
    if spec.arch == "gemma2":
        return Gemma2Config(**gemma, final_logit_softcapping=3.0, attn_logit_softcapping=5.0)
    full = {**gemma.pop("rope_parameters"), "rope_theta": 100_000.0}
    gemma["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    # One global layer in every `pattern` (2 by default: a global layer after each sliding one;
    # the real Gemma 3 has 6).
    gemma["sliding_window_pattern"] = spec.sliding_window_pattern
    text = Gemma3TextConfig(**gemma)
    if spec.arch == "gemma3":
        return text
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    ids = {k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        tie_word_embeddings=spec.tie_word_embeddings,
        **ids,
    )


@torch.no_grad()
def _init_weights(model: torch.nn.Module, spec: TinyModelSpec) -> None:
    generator = torch.Generator().manual_seed(spec.seed)
    # named_parameters() lists a tied lm_head once; sorting fixes the draw order.
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * noise)
        else:
            param.copy_(spec.init_std * noise)


def main(argv: list[str]) -> int:
    """Entry point of ``pagedserve make-tiny-model``."""
    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(
        prog="pagedserve make-tiny-model",
        description="Write a tiny random Llama-family checkpoint with a real BPE tokenizer.",
    )
    parser.add_argument("dir", type=Path, help="output directory (created if needed)")
    parser.add_argument("--arch", "--family", choices=ARCHS, default=defaults.arch)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--num-kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden/heads")
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument(
        "--max-position-embeddings", type=int, default=defaults.max_position_embeddings
    )
    parser.add_argument("--tokenizer-vocab-size", type=int, default=defaults.tokenizer_vocab_size)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument(
        "--rope-scaling", choices=("none", "linear", "llama3", "longrope"), default="none"
    )
    parser.add_argument(
        "--partial-rotary-factor", type=float, default=1.0, help="phi3: rotate part of each head"
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="a sliding window (mistral, mixtral, phi3, qwen2/3 from layer 1; gemma: default 16)",
    )
    parser.add_argument(
        "--sliding-window-pattern",
        type=int,
        default=defaults.sliding_window_pattern,
        help="gemma3: one global layer in every this many (the real models: 6)",
    )
    parser.add_argument("--init-std", type=float, default=defaults.init_std)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "100KB" to shard the weights')
    parser.add_argument(
        "--num-labels",
        type=int,
        default=0,
        help="a sequence classifier of this many labels (for --runner pooling)",
    )
    parser.add_argument("--force", action="store_true", help="write into a non-empty directory")
    parser.add_argument(
        "--eagle3-for",
        type=Path,
        default=None,
        metavar="TARGET",
        help="write instead a random EAGLE-3 head for the checkpoint at TARGET (--seed applies)",
    )
    parser.add_argument(
        "--lora",
        type=Path,
        default=None,
        metavar="BASE",
        help="write instead a random PEFT LoRA adapter for the checkpoint at BASE (nonzero A "
        "and B; --seed applies)",
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="with --lora: its rank")
    parser.add_argument("--lora-alpha", type=float, default=16, help="with --lora: lora_alpha")
    parser.add_argument("--use-rslora", action="store_true", help="with --lora: rsLoRA scaling")
    args = parser.parse_args(argv)

    if args.dir.exists() and any(args.dir.iterdir()) and not args.force:
        parser.error(f"{args.dir} is not empty (use --force to overwrite)")
    if args.lora is not None:
        if not (args.lora / "config.json").is_file():
            parser.error(f"--lora: {args.lora} has no config.json")
        if args.lora_rank < 1:
            parser.error("--lora-rank must be >= 1")
        write_random_adapter(
            args.lora,
            args.dir,
            rank=args.lora_rank,
            alpha=args.lora_alpha,
            use_rslora=args.use_rslora,
            seed=args.seed,
        )
        print(f"wrote a random rank-{args.lora_rank} LoRA adapter for {args.lora} to {args.dir}")
        return 0
    if args.eagle3_for is not None:
        if not (args.eagle3_for / "config.json").is_file():
            parser.error(f"--eagle3-for: {args.eagle3_for} has no config.json")
        write_random_head(args.eagle3_for, args.dir, seed=args.seed)
        print(f"wrote a random EAGLE-3 head for {args.eagle3_for} to {args.dir}")
        return 0
    if args.num_heads % args.num_kv_heads:
        parser.error("--num-heads must be a multiple of --num-kv-heads")
    if args.head_dim is None and args.hidden_size % args.num_heads:
        parser.error("--hidden-size must be a multiple of --num-heads (or give --head-dim)")
    out = write_tiny_model(
        args.dir,
        arch=args.arch,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tokenizer_vocab_size=args.tokenizer_vocab_size,
        tie_word_embeddings=args.tie_word_embeddings,
        rope_scaling=args.rope_scaling,
        partial_rotary_factor=args.partial_rotary_factor,
        sliding_window=args.sliding_window,
        sliding_window_pattern=args.sliding_window_pattern,
        init_std=args.init_std,
        max_shard_size=args.max_shard_size,
        num_labels=args.num_labels,
    )
    print(f"wrote tiny {args.arch} checkpoint to {out}")
    return 0
