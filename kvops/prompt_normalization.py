"""Prompt normalization: canonical whitespace and control characters before tokenization.

Prompts that differ only in invisible ways (CRLF vs LF, a non-breaking space, a stray
zero-width character, trailing spaces, an extra blank line) tokenize differently and so miss
the prefix cache. Normalization maps them to one canonical text. It never truncates and never
drops or reorders words: the sequence of non-whitespace words is preserved exactly, up to the
removed invisible characters and NFC.

`normalize_prompt` applies these rules, in this order:

1. Line endings: CRLF and lone CR become LF (``\\n``).
2. Line-breaking control characters (vertical tab, form feed, NEL U+0085) and the Unicode line
   and paragraph separators (U+2028, U+2029) become LF; the information separators
   U+001C–U+001F become a space. Python counts these as whitespace, so mapping them (rather
   than deleting them) keeps the words on either side apart.
3. Every other control character (Unicode category Cc) except LF and tab is removed, and so are
   the zero-width characters U+200B, U+200C, U+200D, U+2060 and U+FEFF (byte-order mark).
4. Unicode NFC normalization (after the removals, so the result is NFC-stable).
5. Tabs, non-breaking spaces and every other Unicode space separator (category Zs) become an
   ASCII space.
6. Runs of spaces collapse to one space.
7. Leading and trailing spaces are stripped from every line (indentation is not kept: rule 6
   already reduced it to one space).
8. Three or more consecutive newlines collapse to two: paragraph breaks are kept, longer gaps
   are not.
9. Leading and trailing whitespace of the whole text is stripped.

The output contains no control character other than LF, no tab, no run of two spaces and no
space at the start or end of a line. Normalization is idempotent: ``normalize_prompt(normalize_prompt(x))
== normalize_prompt(x)``.

`normalize_messages` applies `normalize_prompt` to the string ``content`` of each chat message.

The engine (`--normalize-prompts`, kvops.engine.config's `NormalizationMode`) and the tenant gateway (a
policy's `normalize`) apply the same rules, so a prompt normalizes alike in front of vLLM and in the engine.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

# Unicode category Zs (space separators), as of Unicode 15; tests check this against unicodedata.
SPACE_SEPARATORS = "\u0020\u00a0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u202f\u205f\u3000"
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"
# Control characters (Cc) that Python treats as whitespace: line breaks become LF, separators a space.
_CONTROL_LINE_BREAKS = "\r\v\f\x85"
_CONTROL_SEPARATORS = "\x1c\x1d\x1e\x1f"
_CONTROL = [chr(c) for c in [*range(0x00, 0x20), *range(0x7F, 0xA0)]]  # category Cc

_TABLE: dict[int, str | None] = {}
for _ch in _CONTROL:
    _TABLE[ord(_ch)] = None
for _ch in ZERO_WIDTH:
    _TABLE[ord(_ch)] = None
for _ch in _CONTROL_LINE_BREAKS + "\u2028\u2029":
    _TABLE[ord(_ch)] = "\n"
for _ch in _CONTROL_SEPARATORS:
    _TABLE[ord(_ch)] = " "
del _TABLE[ord("\n")], _TABLE[ord("\t")]  # kept through rule 3; tab becomes a space in rule 5

_SPACES: dict[int, str] = {ord(ch): " " for ch in SPACE_SEPARATORS + "\t"}
_SPACE_RUN = re.compile(r" {2,}")
_LINE_EDGE_SPACES = re.compile(r" *\n *")
_NEWLINE_RUN = re.compile(r"\n{3,}")


def normalize_prompt(text: str) -> str:
    """Canonicalize the whitespace and control characters of `text` (rules in the module docstring)."""
    text = text.replace("\r\n", "\n")  # rule 1 (a lone CR is mapped with the rule-2 table)
    text = text.translate(_TABLE)  # rules 1-3
    text = unicodedata.normalize("NFC", text)  # rule 4
    text = text.translate(_SPACES)  # rule 5
    text = _SPACE_RUN.sub(" ", text)  # rule 6
    text = _LINE_EDGE_SPACES.sub("\n", text)  # rule 7
    text = _NEWLINE_RUN.sub("\n\n", text)  # rule 8
    return text.strip(" \n")  # rule 9


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of chat `messages` with each string ``content`` normalized; other fields untouched.

    Non-string content (e.g. a list of content parts) is left as it is. The input is not mutated.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        copy = dict(message)
        if isinstance(copy.get("content"), str):
            copy["content"] = normalize_prompt(copy["content"])
        out.append(copy)
    return out
