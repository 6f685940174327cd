"""Incremental detokenization (services/gateway/text/detokenizer.py) against two real tokenizers:
byte-level BPE and SentencePiece-style with byte fallback (tests/gateway/tokenizers_fixtures).

The reference everywhere is :func:`expected_text`, the module's documented guarantee written
with the tokenizer's own full ``decode``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from services.gateway.text.detokenizer import (
    MAX_CONTEXT_TOKENS,
    MAX_HELD_TOKENS,
    MAX_PROMPT_TAIL_TOKENS,
    IncrementalDetokenizer,
)
from tests.gateway.tokenizers_fixtures import (
    all_tokenizers,
    byte_level_tokenizer,
    byte_token_id,
    sentencepiece_tokenizer,
)
from tests.hypothesis_budget import examples

REPLACEMENT = "\ufffd"
TOKENIZERS = all_tokenizers()
NAMES = sorted(TOKENIZERS)

TEXTS = [
    "Hello world, how are you today?",
    "Café, naïve, résumé; déjà vu à Zürich — São Paulo.",
    "你好, 世界. 驫龘 — 中文字节对编码.",
    "Emoji 😀🎉🚀 with skin tone 👍🏽 and flags 🇫🇷🇯🇵.",
    "ZWJ families 👨‍👩‍👧‍👦 and 👩‍💻 and 🏳️‍🌈 in a row: 👨‍👩‍👧👨‍👩‍👧",
    "  two leading spaces,   three inside,\n\nblank line,\ttab and trailing  ",
    " one leading space and\nnew\nlines\n",
    "Mixed: ∑∫√ ≤≥ π≈3.14 € £ ¥ 𝄞 ☃ e\u0301 (combining) Ω ß",
    "def f(x):\n    return x  # 返回 😀\n",
]


def decode(tok: PreTrainedTokenizerBase, ids: Sequence[int], skip: bool) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip)


def expected_text(
    tok: PreTrainedTokenizerBase, prompt: Sequence[int], output: Sequence[int], skip: bool
) -> str:
    """The module's guarantee: ``decode(P + O)[L:]`` with ``L`` the larger of
    ``len(decode(P[:c]))`` (``c``: the prompt's last clean boundary among its last 8 ids) and
    the longest common prefix of ``decode(P)`` and ``decode(P + O)``."""
    full = decode(tok, [*prompt, *output], skip)
    before = decode(tok, prompt, skip)
    common = 0
    while common < min(len(before), len(full)) and before[common] == full[common]:
        common += 1
    for c in range(len(prompt), max(len(prompt) - MAX_PROMPT_TAIL_TOKENS, 0) - 1, -1):
        head = decode(tok, prompt[:c], skip)
        if not head.endswith(REPLACEMENT):
            common = max(common, len(head))
            break
    return full[common:]


def check_text(
    tok: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    output: Sequence[int],
    skip: bool,
    text: str,
) -> None:
    """``text`` is the guaranteed one: exactly for byte-level BPE or when the decode has no
    U+FFFD; otherwise (invalid byte-fallback runs) from the last U+FFFD on."""
    expected = expected_text(tok, prompt, output, skip)
    full = decode(tok, [*prompt, *output], skip)
    if tok is byte_level_tokenizer() or REPLACEMENT not in full:
        assert text == expected
    else:
        assert text.endswith(expected.rsplit(REPLACEMENT, 1)[-1])


def stream(
    tok: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    chunks: Sequence[Sequence[int]],
    skip: bool = True,
) -> list[str]:
    """All deltas of one sample, flush last."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.push(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(list(ids[i : i + size]))
        i += size
    if i < len(ids):
        out.append(list(ids[i:]))
    return out


def encode(tok: PreTrainedTokenizerBase, text: str, bos: bool = False) -> list[int]:
    return tok.encode(text, add_special_tokens=bos)


# -- the fixtures really exercise what they are meant to


def test_fixture_tokenizers_split_multibyte_characters_across_tokens():
    bl, sp = byte_level_tokenizer(), sentencepiece_tokenizer()
    ids = encode(bl, TEXTS[2] + TEXTS[4])
    assert any(REPLACEMENT in bl.decode([i]) for i in ids)  # partial characters in a token
    pieces = sp.convert_ids_to_tokens(encode(sp, TEXTS[3]))
    assert any(p.startswith("<0x") for p in pieces)  # byte fallback
    assert sp.decode(encode(sp, "world")) == "world"  # "▁world": the decoder strips the space
    assert sp.decode(encode(sp, "Hello world")[1:]) == "world"


def test_fixture_tokenizers_are_deterministic():
    for build in (byte_level_tokenizer, sentencepiece_tokenizer):
        fresh = json.loads(build.__wrapped__().backend_tokenizer.to_str())
        cached = json.loads(build().backend_tokenizer.to_str())
        assert fresh == cached


# -- exact text, streamed token by token


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("name", NAMES)
def test_token_by_token_concatenation_equals_full_decode_without_broken_characters(
    name, text, skip
):
    tok = TOKENIZERS[name]
    prompt = encode(tok, "Translate: ", bos=True)
    output = [*encode(tok, text), tok.eos_token_id]
    deltas = stream(tok, prompt, [[i] for i in output], skip)
    assert "".join(deltas) == expected_text(tok, prompt, output, skip)
    assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("name", NAMES)
def test_byte_level_and_sentencepiece_outputs_read_naturally_after_a_prompt(name):
    tok = TOKENIZERS[name]
    prompt = encode(tok, "Q: hi", bos=True)
    output = encode(tok, "Hello 你好 😀 world")
    text = "".join(stream(tok, prompt, [[i] for i in output]))
    # SentencePiece encodes "Hello" as "▁Hello": in context the space is real output.
    assert text == (" Hello 你好 😀 world" if name == "sentencepiece" else "Hello 你好 😀 world")


def test_sentencepiece_first_output_token_keeps_its_leading_space():
    tok = sentencepiece_tokenizer()
    ids = encode(tok, "Hello world and more", bos=True)
    cut = 2  # <s> ▁Hello | ▁w o r l d ...
    assert tok.convert_ids_to_tokens(ids[cut])[0] == "▁"
    text = "".join(stream(tok, ids[:cut], [[i] for i in ids[cut:]]))
    assert text == " world and more"
    assert decode(tok, ids[cut:], True) == "world and more"  # what decoding alone would lose


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_empty_or_bos_only_prompt_strips_like_decode(skip):
    tok = sentencepiece_tokenizer()
    output = encode(tok, "Hello world")
    for prompt in ([], [tok.bos_token_id]):
        text = "".join(stream(tok, prompt, [[i] for i in output], skip))
        assert text == expected_text(tok, prompt, output, skip)
    assert "".join(stream(tok, [], [output], skip)) == "Hello world"
    assert "".join(stream(tok, [tok.bos_token_id], [output], skip)) == (
        "Hello world" if skip else " Hello world"
    )


def test_sentencepiece_prompt_ending_in_special_tokens_keeps_output_space():
    tok = sentencepiece_tokenizer()
    prompt = [*encode(tok, "Hi", bos=True), tok.eos_token_id, tok.bos_token_id]
    output = encode(tok, "there friend")
    assert "".join(stream(tok, prompt, [[i] for i in output])) == " there friend"
    assert "".join(stream(tok, prompt, [[i] for i in output], skip=False)) == " there friend"


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ending_inside_a_character_yields_that_character_as_output(name):
    tok = TOKENIZERS[name]
    ids = encode(tok, "Say 驫 ok", bos=True)
    n_char = len(encode(tok, "驫"))
    assert n_char >= 3  # split into byte tokens in both fixtures
    # Cut the prompt after the first id whose text ends inside 驫.
    cut = next(i for i in range(len(ids)) if decode(tok, ids[:i], True).endswith(REPLACEMENT))
    text = "".join(stream(tok, ids[:cut], [[i] for i in ids[cut:]]))
    assert text == expected_text(tok, ids[:cut], ids[cut:], True)
    assert text.endswith("驫 ok") and REPLACEMENT not in text


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ending_with_a_literal_replacement_character_does_not_repeat_it(name):
    tok = TOKENIZERS[name]
    prompt = encode(tok, f"bad byte {REPLACEMENT}", bos=True)
    output = encode(tok, " and more")
    text = "".join(stream(tok, prompt, [[i] for i in output]))
    assert text == expected_text(tok, prompt, output, True) == " and more"


# -- special tokens


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_are_skipped_or_kept_per_flag(name):
    tok = TOKENIZERS[name]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    output = [*encode(tok, "a b"), eos, bos, *encode(tok, " c 😀"), eos]
    prompt = encode(tok, "x", bos=True)
    skipped = "".join(stream(tok, prompt, [[i] for i in output], skip=True))
    kept = "".join(stream(tok, prompt, [[i] for i in output], skip=False))
    assert skipped == expected_text(tok, prompt, output, True)
    assert kept == expected_text(tok, prompt, output, False)
    assert "</s>" not in skipped and "<s>" not in skipped
    assert kept.count("</s>") == 2 and kept.count("<s>") == 1


@pytest.mark.parametrize("name", NAMES)
def test_pushes_of_only_skipped_tokens_return_nothing(name):
    tok = TOKENIZERS[name]
    detok = IncrementalDetokenizer(tok, encode(tok, "x", bos=True))
    assert detok.push([tok.eos_token_id, tok.bos_token_id]) == ""
    assert detok.push([]) == ""
    assert detok.flush() == ""


# -- broken and invalid bytes


@pytest.mark.parametrize("name", NAMES)
def test_incomplete_character_is_held_until_its_last_byte(name):
    tok = TOKENIZERS[name]
    detok = IncrementalDetokenizer(tok, encode(tok, "x", bos=True))
    assert detok.push(encode(tok, "ok")) != ""
    byte_ids = [byte_token_id(tok, b) for b in "😀".encode()]
    assert [detok.push([i]) for i in byte_ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_text_before_an_incomplete_character_in_the_same_token_is_not_held():
    tok = byte_level_tokenizer()
    # 'ĠðŁĺ' is " " + the first three bytes of 😀 in one token.
    space_and_partial = tok.convert_tokens_to_ids("ĠðŁĺ")
    assert decode(tok, [space_and_partial], True) == " " + REPLACEMENT
    detok = IncrementalDetokenizer(tok, encode(tok, "x", bos=True))
    assert detok.push([space_and_partial]) == " "
    assert detok.push([byte_token_id(tok, 0x80)]) == "😀"


@pytest.mark.parametrize("name", NAMES)
def test_invalid_trailing_bytes_come_out_at_flush(name):
    tok = TOKENIZERS[name]
    prompt = encode(tok, "x", bos=True)
    output = [*encode(tok, "ok"), byte_token_id(tok, 0xE4), byte_token_id(tok, 0xBD)]
    deltas = stream(tok, prompt, [[i] for i in output])
    assert REPLACEMENT not in "".join(deltas[:-1])
    assert deltas[-1].endswith(REPLACEMENT)
    assert "".join(deltas) == expected_text(tok, prompt, output, True)


@pytest.mark.parametrize("name", NAMES)
def test_invalid_bytes_mid_stream_appear_as_in_full_decode(name):
    tok = TOKENIZERS[name]
    prompt = encode(tok, "x", bos=True)
    output = [*encode(tok, "a"), byte_token_id(tok, 0xFF), byte_token_id(tok, 0xC3)]
    output += encode(tok, "b 😀")
    deltas = stream(tok, prompt, [[i] for i in output])
    expected = expected_text(tok, prompt, output, True)
    assert REPLACEMENT in expected
    assert "".join(deltas) == expected


def test_long_invalid_byte_run_is_released_before_flush_and_stays_exact():
    tok = byte_level_tokenizer()
    prompt = encode(tok, "x", bos=True)
    output = [byte_token_id(tok, 0xF0)] * 100 + encode(tok, "end")
    deltas = stream(tok, prompt, [[i] for i in output])
    assert "".join(deltas) == REPLACEMENT * 100 + "end" == expected_text(tok, prompt, output, True)
    first_release = next(i for i, d in enumerate(deltas) if d)
    assert first_release <= MAX_HELD_TOKENS + 1  # held a bounded number of tokens, not all


# -- cost


@pytest.mark.parametrize("name", NAMES)
def test_decode_window_stays_bounded_over_a_long_stream(name):
    tok = TOKENIZERS[name]
    output = encode(tok, " ".join(TEXTS) * 6)
    detok = IncrementalDetokenizer(tok, encode(tok, "x", bos=True))
    sizes: list[int] = []
    inner = detok._decode

    def counting_decode(ids: Sequence[int]) -> str:
        sizes.append(len(ids))
        return inner(ids)

    detok._decode = counting_decode  # type: ignore[method-assign]
    text = "".join(detok.push([i]) for i in output) + detok.flush()
    assert text == expected_text(tok, encode(tok, "x", bos=True), output, True)
    assert len(output) > 1500
    assert max(sizes) <= MAX_CONTEXT_TOKENS + 4  # O(window), not O(length)
    assert sum(sizes) <= 6 * len(output)


@pytest.mark.parametrize("name", NAMES)
def test_one_large_push_then_tokens_keeps_the_window_short(name):
    tok = TOKENIZERS[name]
    output = encode(tok, TEXTS[4] * 20)
    prompt = encode(tok, "x", bos=True)
    detok = IncrementalDetokenizer(tok, prompt)
    text = detok.push(output[:-5])
    assert len(detok._window) <= MAX_CONTEXT_TOKENS + 5
    text += "".join(detok.push([i]) for i in output[-5:]) + detok.flush()
    assert text == expected_text(tok, prompt, output, True)


# -- lifecycle


def test_flush_is_idempotent_and_push_after_flush_raises():
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(encode(tok, "hi")) == "hi"
    assert detok.flush() == "" and detok.flush() == "" and detok.finished
    with pytest.raises(RuntimeError):
        detok.push(encode(tok, "more"))
    assert detok.text == "hi"


# -- properties: random texts, random prompt/output split, random chunking

_ATOMS = [
    "a",
    "Hello",
    "world",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    ".",
    "é",
    "ñ",
    "ü",
    "ß",
    "Ω",
    "e\u0301",
    "你",
    "好",
    "世界",
    "驫",
    "龘",
    "の",
    "😀",
    "🎉",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "☃",
    "𝄞",
    "€",
]
_text = st.lists(st.sampled_from(_ATOMS), max_size=25).map("".join)
_sizes = st.lists(st.integers(1, 6), max_size=40)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(NAMES),
    prompt_text=_text,
    text=_text,
    cut=st.integers(0, 200),
    sizes=_sizes,
    skip=st.booleans(),
    bos=st.booleans(),
    specials=st.lists(st.integers(0, 200), max_size=3),
)
def test_random_text_in_random_chunks_equals_full_decode(
    name, prompt_text, text, cut, sizes, skip, bos, specials
):
    tok = TOKENIZERS[name]
    ids = encode(tok, prompt_text + text, bos=bos)
    for pos in specials:  # EOS tokens sprinkled in
        ids.insert(min(pos, len(ids)), tok.eos_token_id)
    cut = min(cut, len(ids))
    prompt, output = ids[:cut], ids[cut:]
    deltas = stream(tok, prompt, split(output, sizes), skip)
    check_text(tok, prompt, output, skip, "".join(deltas))
    if REPLACEMENT not in decode(tok, ids, skip):  # an EOS kept inside a character breaks it
        assert all(REPLACEMENT not in d for d in deltas)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(NAMES),
    prompt=st.lists(st.integers(0, 400), max_size=8),
    output=st.lists(st.integers(0, 400), max_size=MAX_HELD_TOKENS - 8),
    sizes=_sizes,
    skip=st.booleans(),
)
def test_random_token_ids_match_full_decode(name, prompt, output, sizes, skip):
    """Arbitrary ids, invalid bytes included. Exact for byte-level BPE; for byte fallback exact
    when the decode has no U+FFFD (the documented limit), and the text after the last U+FFFD
    always comes out right."""
    tok = TOKENIZERS[name]
    text = "".join(stream(tok, prompt, split(output, sizes), skip))
    check_text(tok, prompt, output, skip, text)


_SOUP_BYTES = [0xF0, 0x9F, 0x98, 0x80, 0xE4, 0xBD, 0xA0, 0xC3, 0xFF, 0x41]


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(NAMES),
    soup=st.lists(st.sampled_from(_SOUP_BYTES), min_size=MAX_HELD_TOKENS, max_size=120),
    sizes=_sizes,
)
def test_byte_soup_longer_than_the_hold_limit_keeps_the_window_bounded(name, soup, sizes):
    """Invalid bytes (mostly no ASCII) for longer than MAX_HELD_TOKENS: exact for byte-level
    BPE, bounded window for both."""
    tok = TOKENIZERS[name]
    prompt = encode(tok, "x", bos=True)
    output = [byte_token_id(tok, b) for b in soup]
    detok = IncrementalDetokenizer(tok, prompt)
    text, longest = "", 0
    for chunk in split(output, [min(s, 3) for s in sizes]):
        text += detok.push(chunk)
        longest = max(longest, len(detok._window))
    text += detok.flush()
    check_text(tok, prompt, output, True, text)
    assert longest <= MAX_CONTEXT_TOKENS + MAX_HELD_TOKENS + 3
