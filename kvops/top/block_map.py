"""The block map: a decoded block-state string (one code per block, kvops.snapshot) laid out in cells.

Pure functions, no Textual. When there are more blocks than cells, each cell covers N blocks and
shows the most interesting state among them, by `PRIORITY` (a single swapped or pending-free block
is worth seeing; a cell of mostly free blocks with one full one shows full). The caller prints
"1 cell = N blocks".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rich.text import Text

from kvops.snapshot import BLOCK_STATE_CODES

# Most interesting first.
PRIORITY = ("swapped", "pending_free", "filling", "full", "cached", "free")
CODE_PRIORITY = "".join(BLOCK_STATE_CODES[state] for state in PRIORITY)  # "spfFc."

# Each state: a glyph (readable without colour) and a colour from the 16 ANSI ones.
STYLE = {
    "free": ("·", "bright_black"),
    "cached": ("▒", "blue"),
    "full": ("█", "green"),
    "filling": ("▓", "yellow"),
    "pending_free": ("░", "magenta"),
    "swapped": ("s", "red"),
}
UNKNOWN = ("?", "white")
_CODE_STYLE = {BLOCK_STATE_CODES[state]: style for state, style in STYLE.items()}

# Codes -> rank characters ("0" dullest ... "5" most interesting), so max() of a slice picks the
# winner in C; and back.
_TO_RANK = str.maketrans({code: str(rank) for rank, code in enumerate(reversed(CODE_PRIORITY))})
_FROM_RANK = str.maketrans({str(rank): code for rank, code in enumerate(reversed(CODE_PRIORITY))})
_RUNS = re.compile(r"(.)\1*")


@dataclass(frozen=True)
class BlockGrid:
    rows: list[str]  # one code per cell
    blocks_per_cell: int
    total_blocks: int

    @property
    def scale(self) -> str:
        return f"1 cell = {self.blocks_per_cell} block{'s' if self.blocks_per_cell != 1 else ''}"


def aggregate(codes: str, per_cell: int) -> str:
    """One code per `per_cell` blocks: the most interesting state in each group (`PRIORITY`)."""
    if per_cell <= 1:
        return codes
    ranks = codes.translate(_TO_RANK)
    unknown = set(ranks) - set("012345")
    if unknown:  # codes kvops does not know (a newer engine): count them as the dullest state
        ranks = ranks.translate(str.maketrans(dict.fromkeys(unknown, "0")))
    cells = [max(ranks[i:i + per_cell]) for i in range(0, len(ranks), per_cell)]
    return "".join(cells).translate(_FROM_RANK)


def blocks_per_cell(total: int, width: int, height: int) -> int:
    cells = max(1, width) * max(1, height)
    return max(1, math.ceil(total / cells))


def layout(codes: str, width: int, height: int) -> BlockGrid:
    """`codes` (decode_block_map output) in at most `height` rows of `width` cells."""
    width = max(1, width)
    per_cell = blocks_per_cell(len(codes), width, height)
    cells = aggregate(codes, per_cell)
    rows = [cells[i:i + width] for i in range(0, len(cells), width)]
    return BlockGrid(rows=rows, blocks_per_cell=per_cell, total_blocks=len(codes))


def render_rows(rows: list[str]) -> Text:
    """Rich text of the grid: runs of equal cells share one span, so 16k cells stay cheap."""
    text = Text(no_wrap=True, overflow="crop")
    for i, row in enumerate(rows):
        if i:
            text.append("\n")
        for match in _RUNS.finditer(row):
            glyph, colour = _CODE_STYLE.get(match.group(1), UNKNOWN)
            text.append(glyph * len(match.group(0)), style=colour)
    return text


def legend(counts: dict[str, int] | None = None) -> Text:
    """The state glyphs and colours, with block counts when given."""
    text = Text(no_wrap=False)
    for state in reversed(PRIORITY):
        glyph, colour = STYLE[state]
        text.append(glyph, style=colour)
        label = state.replace("_", " ")
        text.append(f" {label} {counts.get(state, 0)}  " if counts is not None else f" {label}  ")
    return text
