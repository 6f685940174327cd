# ruff: noqa: RUF001 -- the corpus is multilingual on purpose
"""Two real, small, deterministic tokenizers built offline with the ``tokenizers`` library and
wrapped as ``transformers`` fast tokenizers, for detokenizer tests.

* :func:`byte_level_tokenizer` — GPT-2 / Llama-3 style: ByteLevel pre-tokenizer and decoder
  (``Ġ`` for spaces), all 256 bytes in the alphabet, so CJK characters and emoji that the few
  merges do not cover are split into byte tokens across token boundaries.
* :func:`sentencepiece_tokenizer` — Llama-2 style: BPE with ``byte_fallback=True``, the
  ``<0x00>``..``<0xFF>`` byte tokens at ids 3..258, a Metaspace (``▁``) pre-tokenizer and the
  ``Replace(▁→' ') + ByteFallback + Fuse + Strip(1 leading space)`` decoder of Llama-2's
  ``tokenizer.json``. Characters outside its small alphabet are encoded as byte tokens.

Both add a BOS token when encoding with special tokens and have an EOS token. They are built
once per process (cached) and are identical across runs: BPE training is deterministic.
"""

from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Hello world! Hello there, how are you today? I am fine, thank you very much.",
    "Streaming text one token at a time is what a server does for every request.",
    "Café, naïve, résumé, façade, jalapeño, São Paulo, Zürich, Ærøskøbing, déjà vu.",
    "Le café est très chaud. L'été à Paris, c'est génial. Où est la bibliothèque ?",
    "Ich möchte ein Stück Kuchen. Schöne Grüße aus München und Köln.",
    "Привет, как дела? Всё хорошо, спасибо. Москва и Санкт-Петербург.",
    "Γειά σου κόσμε. Καλημέρα σε όλους.",
    "你好，世界。我很感谢你的热情。今天天气很好，我们去公园散步吧。",
    "中文分词和字节对编码。机器学习模型生成文本，一次一个词元。",
    "日本語のテキストも少し。こんにちは、お元気ですか？東京は晴れです。",
    "한국어 문장도 조금 있습니다. 안녕하세요, 반갑습니다.",
    "Emoji: 😀 😃 😄 🎉 🚀 👍 👍🏽 ❤️ 🇫🇷 🇯🇵 and families 👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈.",
    "Math: ∑ ∫ √ ≤ ≥ ≠ ∞ π ≈ 3.14159; arrows → ← ↔; currency € £ ¥ ₹.",
    "def main():\n    print('hello')\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "Lines\nwith\n\nnewlines and  double  spaces,\ttabs, and   triple spaces.",
    "the the the and and of of to to in in is is it it that that was was for for on on",
)

# Characters the SentencePiece-style fixture has as pieces; everything else is byte fallback.
SENTENCEPIECE_ALPHABET = (
    "".join(chr(c) for c in range(0x20, 0x7F)).replace(" ", "") + "\n▁éèàçüöäñ你好的我"
)

BOS = "<s>"
EOS = "</s>"
UNK = "<unk>"


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) with ``<s>``/``</s>``/``<unk>`` as special tokens 0..2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    return _wrap(tok)


@functools.cache
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style BPE with byte fallback; ``<unk>``=0, ``<s>``=1, ``</s>``=2, bytes 3..258."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    # 1. Learn merges over a small alphabet: rare characters (most CJK, all emoji) stay out.
    learner = Tokenizer(models.BPE(unk_token=UNK))
    learner.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        min_frequency=2,
        initial_alphabet=list(SENTENCEPIECE_ALPHABET),
        limit_alphabet=len(SENTENCEPIECE_ALPHABET),  # exactly this alphabet: deterministic
        show_progress=False,
    )
    learner.train_from_iterator(CORPUS, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    # 2. Rebuild it Llama-2 style: specials, then the 256 byte tokens, then the learned vocab.
    vocab: dict[str, int] = {UNK: 0, BOS: 1, EOS: 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([UNK, BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    return _wrap(tok)


def all_tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    """Both fixtures by name, for ``pytest.mark.parametrize``."""
    return {"byte_level": byte_level_tokenizer(), "sentencepiece": sentencepiece_tokenizer()}


def _gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def byte_token_id(tokenizer: PreTrainedTokenizerFast, byte: int) -> int:
    """The id of the token that is exactly one raw byte, for either fixture."""
    vocab = tokenizer.get_vocab()
    piece = f"<0x{byte:02X}>"
    return vocab[piece] if piece in vocab else vocab[_gpt2_byte_to_char()[byte]]
