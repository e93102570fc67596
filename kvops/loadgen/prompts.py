"""Prompt text of exact token counts, and the whitespace noise that prompt normalization undoes."""

from __future__ import annotations

import hashlib
import random
import re
import threading
from dataclasses import dataclass
from typing import Any

from kvops.loadgen.spec import LoadError
from kvops.logs import quiet_transformers
from kvops.prose import SENTENCES

# Whitespace edits that `normalize_prompt` undoes: between words, at a line break, at the very end.
_SPACE_NOISE = ("  ", "\t", "\u00a0", " \t", "   ", "\u00a0 ")
_NEWLINE_NOISE = ("\r\n", " \n", "\t\n", "\n ", " \r\n", "\u00a0\n")
_END_NOISE = (" ", "\n", "\r\n", "  ", " \n")


def add_noise(text: str, rng: random.Random, rate: float = 0.05) -> str:
    """`text` with whitespace noise (extra spaces, tabs, NBSP, CRLF, trailing blanks) that prompt
    normalization removes again. The first edit lands among the first few gaps, as copy-pasted text
    has it from the start: a noisy prompt misses the prefix cache from early on, not only in its tail."""
    gaps = [m.start() for m in re.finditer(r"[ \n]", text)]
    edits = {i for i in gaps if rng.random() < rate}
    if gaps:
        edits.add(gaps[rng.randrange(min(3, len(gaps)))])
    out: list[str] = []
    last = 0
    for i in sorted(edits):
        out.append(text[last:i])
        out.append(rng.choice(_SPACE_NOISE if text[i] == " " else _NEWLINE_NOISE))
        last = i + 1
    out.append(text[last:])
    if not gaps or rng.random() < 0.5:
        out.append(rng.choice(_END_NOISE))
    return "".join(out)


@dataclass(frozen=True)
class _Vocabulary:
    """What prompts are assembled from, each piece with its token count. Byte-level BPE tokenizes the
    pre-tokenizer's pieces independently, so a text joined from pieces at piece boundaries has exactly
    the sum of their counts: no need to tokenize each prompt."""

    line_sentences: list[list[tuple[str, int]]]  # each prose sentence as it starts a line
    mid_sentences: list[list[tuple[str, int]]]  # ... and after another sentence (" The ...")
    heads: list[str]  # one-token words that start a line ("Harbour"), sorted
    words: list[str]  # one-token words after a space (" harbour"), without the space, sorted


def _pieces(tokenizer: Any, text: str) -> list[tuple[str, int]]:
    spans = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    pieces = [text[a:b] for _, (a, b) in spans]
    counts = tokenizer(pieces, add_special_tokens=False).input_ids
    return [(piece, len(ids)) for piece, ids in zip(pieces, counts, strict=True)]


# By id() of the tokenizer, which the entry keeps alive so that the id cannot be reused.
_VOCABULARIES: dict[int, tuple[Any, _Vocabulary]] = {}


def _vocabulary(tokenizer: Any) -> _Vocabulary:
    if id(tokenizer) not in _VOCABULARIES:
        _VOCABULARIES[id(tokenizer)] = (tokenizer, _build_vocabulary(tokenizer))
    return _VOCABULARIES[id(tokenizer)][1]


def _build_vocabulary(tokenizer: Any) -> _Vocabulary:
    if getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None) is None:
        raise LoadError("the tokenizer is not a fast (Rust) tokenizer with a pre-tokenizer: exact prompt lengths "
                        "cannot be built with it")
    vocab = tokenizer.get_vocab()
    heads = sorted(t for t in vocab if re.fullmatch(r"[A-Za-z]{3,}", t))
    words = sorted(t[1:] for t in vocab if re.fullmatch(r"\u0120[a-z]{3,}", t))  # "Ġ" marks a leading space
    heads = [h for h, ids in zip(heads, tokenizer(heads, add_special_tokens=False).input_ids, strict=True)
             if len(ids) == 1]
    spaced = tokenizer([" " + w for w in words], add_special_tokens=False).input_ids
    words = [w for w, ids in zip(words, spaced, strict=True) if len(ids) == 1]
    if len(heads) < 100 or len(words) < 100:
        raise LoadError("the tokenizer is not a byte-level BPE with a GPT-2 style vocabulary: exact prompt lengths "
                        "cannot be built with it")
    return _Vocabulary([_pieces(tokenizer, s) for s in SENTENCES], [_pieces(tokenizer, " " + s) for s in SENTENCES],
                       heads, words)


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class PromptBuilder:
    """Prompt text of exact token counts: shared prefixes (fixed per key and group) and unique parts.

    A unique part starts with a word chosen by the request's index (distinct for the first
    ~14 000 requests of a run with the default tokenizer, then the first two words are), so two
    requests never share a token beyond their common prefix. Clean text is normalization-stable:
    single spaces, no blank at a line's edges, no trailing whitespace.
    """

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self._vocab = _vocabulary(tokenizer)
        # Words ("Harbour") before word pieces ("urther"): prompts read better while the words last.
        words = [h for h in self._vocab.heads if re.fullmatch(r"[A-Z][a-z]+", h)]
        pieces = [h for h in self._vocab.heads if not re.fullmatch(r"[A-Z][a-z]+", h)]
        shuffle = random.Random(f"{seed}/heads").shuffle
        shuffle(words)
        shuffle(pieces)
        self._heads = words + pieces
        self._prefixes: dict[tuple[str, int, int], str] = {}
        self._check()

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _check(self) -> None:
        rng = random.Random(self.seed)
        for n in (1, 2, 3, 17, 160):
            text = self.prefix("check", 0, n + 1) + self.unique(n, n, rng)
            if self.count(text) != 2 * n + 1:
                raise LoadError(f"the tokenizer splits assembled text differently from its pieces ({self.count(text)} "
                                f"tokens, expected {2 * n + 1}): exact prompt lengths cannot be built with it")

    def _compose(self, head: list[str], n_tokens: int, rng: random.Random) -> str:
        """`head` (one-token units, the first one starting a line), then prose, exactly `n_tokens` tokens."""
        vocab = self._vocab
        parts = head[:n_tokens]
        left = n_tokens - len(parts)
        line_start = not parts
        while left > 0:
            k = rng.randrange(len(vocab.line_sentences))
            sentence = vocab.line_sentences[k] if line_start else vocab.mid_sentences[k]
            for piece, cost in sentence:
                if cost > left:
                    break
                parts.append(piece)
                left -= cost
                line_start = False
            else:
                if left >= 2 and rng.random() < 1 / 6:  # a paragraph break, never the last token
                    parts.append("\n")
                    left -= 1
                    line_start = True
                continue
            while left > 0:  # the sentence did not fit: finish with one-token words
                parts.append(rng.choice(vocab.heads) if line_start else " " + rng.choice(vocab.words))
                left -= 1
                line_start = False
        return "".join(parts)

    def prefix(self, key: str, group: int, n_tokens: int) -> str:
        """The shared prefix `group` of `key`: `n_tokens` tokens (at least 2), ending in a line break."""
        if n_tokens < 2:
            raise ValueError("a shared prefix has at least 2 tokens")
        cached = self._prefixes.get((key, group, n_tokens))
        if cached is None:
            head = self._heads[(_stable_hash(key) + group) % len(self._heads)]
            rng = random.Random(f"{self.seed}/prefix/{key}/{group}")
            cached = self._compose([head, ":"], n_tokens - 1, rng) + "\n"
            self._prefixes[(key, group, n_tokens)] = cached
        return cached

    def unique(self, index: int, n_tokens: int, rng: random.Random) -> str:
        """The unique part of request `index` of the run: `n_tokens` tokens, new text from its first token."""
        heads, words = self._heads, self._vocab.words
        head = [heads[index % len(heads)], " " + words[(index // len(heads)) % len(words)], ":"]
        return self._compose(head, n_tokens, rng)


_TOKENIZERS: dict[str | None, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def load_tokenizer(path: str | None = None) -> Any:
    """The tokenizer prompts are built with (the default model's unless `path`), loaded once per process."""
    with _TOKENIZERS_LOCK:
        if path not in _TOKENIZERS:
            from kvops.engine.weights import load_tokenizer as load

            with quiet_transformers():
                _TOKENIZERS[path] = load(path)
        return _TOKENIZERS[path]
