"""Prompt normalization and the shadow prefix cache (pure Python, no model).

See docs/server.md, "Prompt normalization", and docs/engine.md, "Prefix caching".
"""

from __future__ import annotations

import copy
import unicodedata
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvops.engine.config import NormalizationMode
from kvops.engine.hashing import block_hashes
from kvops.engine.shadow_cache import ShadowPrefixCache
from kvops.prompt_normalization import (
    SPACE_SEPARATORS,
    ZERO_WIDTH,
    normalize_messages,
    normalize_prompt,
)

# Characters normalization cares about, mixed into arbitrary text so hypothesis hits them often.
TRICKY = list(
    " \t\n\r\v\f\x00\x07\x1b\x1c\x1f\x7f\x85\x9f\u00a0\u1680\u2000\u2003\u200a\u202f\u205f\u3000"
    "\u200b\u200c\u200d\u2060\ufeff\u2028\u2029\u0301\u0327e\u00e9\u00ad\u200e"
)
texts = st.text(alphabet=st.one_of(st.sampled_from(TRICKY), st.characters()), max_size=80)


def cleaned_words(text: str) -> list[str]:
    """The words of `text` once invisible characters are removed and NFC applied: what must survive."""
    kept = "".join(
        ch for ch in text if ch not in ZERO_WIDTH and (unicodedata.category(ch) != "Cc" or ch.isspace())
    )
    return unicodedata.normalize("NFC", kept).split()


# ------------------------------------------------------------------ properties


@given(texts)
def test_idempotent(text: str) -> None:
    once = normalize_prompt(text)
    assert normalize_prompt(once) == once


@given(texts)
def test_words_preserved_exactly(text: str) -> None:
    assert normalize_prompt(text).split() == cleaned_words(text)


@given(texts)
def test_output_is_canonical(text: str) -> None:
    out = normalize_prompt(text)
    assert all(ch == "\n" or unicodedata.category(ch) != "Cc" for ch in out)
    assert not any(ch in ZERO_WIDTH for ch in out)
    assert all(ch in " \n" for ch in out if ch.isspace())
    assert "  " not in out
    assert " \n" not in out and "\n " not in out  # no trailing (or leading) spaces on a line
    assert "\n\n\n" not in out
    assert out == out.strip()
    assert unicodedata.is_normalized("NFC", out)


def test_space_and_control_tables_match_unicode() -> None:
    zs = {chr(c) for c in range(0x3100) if unicodedata.category(chr(c)) == "Zs"}
    assert zs == set(SPACE_SEPARATORS)
    for ch in zs:
        assert normalize_prompt(f"a{ch}b") == "a b"
    for c in [*range(0x20), *range(0x7F, 0xA0)]:
        assert unicodedata.category(chr(c)) == "Cc"
        out = normalize_prompt(f"a{chr(c)}b")
        if chr(c).isspace():  # a whitespace control never glues two words together
            assert out in ("a b", "a\nb")
        else:
            assert out == "ab"


# -------------------------------------------------------------------- examples


def test_example() -> None:
    assert normalize_prompt("Hello,\u00a0 world\r\n\r\n\r\n\tBye\u200b") == "Hello, world\n\nBye"


def test_whitespace_variants_normalize_to_the_same_string() -> None:
    variants = [
        "Summarize:\nThe quick brown fox.",
        "Summarize:\r\nThe quick  brown fox.",
        "  Summarize: \n\tThe quick\u00a0brown fox.\u200b  ",
        "\ufeffSummarize:\u3000\r\nThe\u2009quick \t brown fox.\n",
        "Summarize:\rThe quick\u200b brown\u202ffox.",
    ]
    assert {normalize_prompt(v) for v in variants} == {"Summarize:\nThe quick brown fox."}


def test_paragraphs_kept_longer_gaps_collapsed() -> None:
    assert normalize_prompt("a\nb") == "a\nb"
    assert normalize_prompt("a\n\nb") == "a\n\nb"
    assert normalize_prompt("a\n\n\n\n\nb") == "a\n\nb"
    assert normalize_prompt("a\n \n\t\n \nb") == "a\n\nb"
    assert normalize_prompt("a\r\n\r\nb") == "a\n\nb"


def test_nfc_and_invisible_characters() -> None:
    assert normalize_prompt("cafe\u0301") == "caf\u00e9"
    assert normalize_prompt("cafe\u200b\u0301") == "caf\u00e9"  # removal happens before NFC
    assert normalize_prompt("zero\u200bwidth\u2060join\u200dhere") == "zerowidthjoinhere"
    assert normalize_prompt("page one\fpage two") == "page one\npage two"


def test_never_truncates() -> None:
    text = " ".join(f"word{i}" for i in range(20_000))
    assert normalize_prompt(text) == text


def test_empty_and_blank() -> None:
    assert normalize_prompt("") == ""
    assert normalize_prompt(" \t\r\n\u00a0\u200b\n") == ""


def test_normalize_messages() -> None:
    parts = [{"type": "text", "text": "a  b"}]
    messages = [
        {"role": "system", "content": " You are\u00a0helpful. ", "name": "sys  x"},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert messages == before  # input not mutated
    assert out[0] == {"role": "system", "content": "You are helpful.", "name": "sys  x"}
    assert out[1] == messages[1] and out[1]["content"] is parts  # non-string content untouched
    assert out[2] == messages[2]
    assert all(o is not m for o, m in zip(out, messages, strict=True))


def test_mode_enum() -> None:
    assert NormalizationMode("shadow") is NormalizationMode.SHADOW
    assert [m.value for m in NormalizationMode] == ["off", "shadow", "on"]
    assert NormalizationMode.ON == "on" and str(NormalizationMode.OFF) == "off"


# ---------------------------------------------------------------- shadow cache


def char_tokens(text: str) -> list[int]:
    """A stand-in tokenizer: one token per character."""
    return [ord(ch) for ch in text]


def test_shadow_predicts_hits_for_prompts_equal_after_normalization() -> None:
    bs = 4
    first = "Summarize:\nThe quick brown fox jumps."
    second = "  Summarize:\r\n\tThe quick\u00a0 brown fox jumps.\u200b"
    assert normalize_prompt(first) == normalize_prompt(second)
    # the raw prompts would share (almost) nothing
    raw = ShadowPrefixCache(capacity_blocks=64, block_size=bs)
    raw.observe(char_tokens(first), "t")
    assert raw.observe(char_tokens(second), "t") == 0

    shadow = ShadowPrefixCache(capacity_blocks=64, block_size=bs)
    ids = char_tokens(normalize_prompt(first))
    assert shadow.observe(ids, "t") == 0
    hits = shadow.observe(char_tokens(normalize_prompt(second)), "t")
    assert hits == (len(ids) - 1) // bs * bs > 0


@pytest.mark.parametrize(("length", "expected_blocks"), [(16, 3), (17, 4), (18, 4), (4, 0), (1, 0), (0, 0)])
def test_shadow_never_hits_the_last_token(length: int, expected_blocks: int) -> None:
    shadow = ShadowPrefixCache(capacity_blocks=64, block_size=4)
    ids = list(range(length))
    shadow.observe(ids, None)
    assert shadow.observe(ids, None) == expected_blocks * 4


def test_shadow_keys_match_the_real_cache() -> None:
    shadow = ShadowPrefixCache(capacity_blocks=64, block_size=4)
    ids = list(range(10))
    shadow.observe(ids, "tenant-a")
    assert len(shadow) == 2
    assert all(h in shadow for h in block_hashes(ids, 4, "tenant-a"))


def test_shadow_different_salts_never_hit() -> None:
    shadow = ShadowPrefixCache(capacity_blocks=64, block_size=4)
    ids = list(range(21))
    assert shadow.observe(ids, "a") == 0
    assert shadow.observe(ids, "b") == 0
    assert shadow.observe(ids, None) == 0
    assert shadow.observe(ids, "a") == 20
    assert shadow.observe(ids, "b") == 20


def test_shadow_capacity_evicts_least_recently_used() -> None:
    bs = 2
    shadow = ShadowPrefixCache(capacity_blocks=6, block_size=bs)
    a, b, c = ([base + i for i in range(7)] for base in (100, 200, 300))  # 3 full blocks each
    shadow.observe(a, None)
    shadow.observe(b, None)
    assert len(shadow) == 6
    assert shadow.observe(a, None) == 6  # touches a: b is now least recently used
    shadow.observe(c, None)  # evicts b's three blocks
    assert len(shadow) == 6
    assert shadow.observe(a, None) == 6
    assert shadow.observe(c, None) == 6
    assert shadow.observe(b, None) == 0


def test_shadow_evicts_a_chain_tail_before_its_prefix() -> None:
    shadow = ShadowPrefixCache(capacity_blocks=4, block_size=2)
    a, b = [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]
    shadow.observe(a, None)
    shadow.observe(b, None)  # 6 blocks for 4 slots: a's last two blocks go, its first stays
    assert len(shadow) == 4
    assert shadow.observe(a, None) == 2


def test_shadow_hit_rate_and_counters() -> None:
    shadow = ShadowPrefixCache(capacity_blocks=64, block_size=4)
    assert shadow.hit_rate == 0.0
    ids = list(range(13))
    shadow.observe(ids, None)
    shadow.observe(ids, None)
    shadow.observe(list(range(50, 55)), None)
    assert shadow.queries_total == 13 + 13 + 5
    assert shadow.hits_total == 12
    assert shadow.hit_rate == pytest.approx(12 / 31)


def test_shadow_resize_clears_blocks_and_keeps_counters() -> None:
    shadow = ShadowPrefixCache(capacity_blocks=64, block_size=4)
    ids = list(range(13))
    shadow.observe(ids, None)
    shadow.observe(ids, None)
    shadow.resize(capacity_blocks=8, block_size=2)
    assert len(shadow) == 0 and (shadow.capacity_blocks, shadow.block_size) == (8, 2)
    assert (shadow.queries_total, shadow.hits_total) == (26, 12)
    assert shadow.observe(ids, None) == 0
    assert len(shadow) == 6
    with pytest.raises(ValueError):
        shadow.resize(0, 2)
    with pytest.raises(ValueError):
        ShadowPrefixCache(capacity_blocks=4, block_size=0)


prompts = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=50)
@given(
    st.integers(1, 8),
    st.integers(1, 4),
    st.lists(st.tuples(prompts, st.sampled_from([None, "a", "b"])), max_size=20),
)
def test_shadow_bounds(capacity: int, bs: int, observations: Sequence[tuple[list[int], str | None]]) -> None:
    shadow = ShadowPrefixCache(capacity_blocks=capacity, block_size=bs)
    for ids, salt in observations:
        hits = shadow.observe(ids, salt)
        assert hits % bs == 0 and 0 <= hits <= max(0, (len(ids) - 1) // bs * bs)
        assert len(shadow) <= capacity
        assert 0 <= shadow.hits_total <= shadow.queries_total
