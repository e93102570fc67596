"""The block map's grid: a decoded block-state string (one code per block, kvops.schema.snapshot) laid out in
cells, a `BlockGrid`; the panel that shows it is kvops.top.widgets.block_map.
The tenant view does the same with the owner map (one tenant letter per block).

Pure functions, no Textual. When there are more blocks than cells, each cell covers N blocks and
shows the most interesting state among them, by `PRIORITY` (a single swapped or pending-free block
is worth seeing; a cell of mostly free blocks with one full one shows full). The caller prints
"1 cell = N blocks".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Span, Text

from kvops.schema.snapshot import BLOCK_STATE_CODES, NO_OWNER_CODE, OTHER_OWNER_CODE, OWNER_CODES

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


def layout(codes: str, width: int, height: int, merge: Callable[[str, int], str] | None = None) -> BlockGrid:
    """`codes` (decode_block_map output) in at most `height` rows of `width` cells; `merge` makes one
    cell of several blocks (default: `aggregate`, the most interesting state)."""
    width = max(1, width)
    per_cell = blocks_per_cell(len(codes), width, height)
    cells = (merge or aggregate)(codes, per_cell)
    rows = [cells[i:i + width] for i in range(0, len(cells), width)]
    return BlockGrid(rows=rows, blocks_per_cell=per_cell, total_blocks=len(codes))


def state_style(code: str) -> tuple[str, str]:
    return _CODE_STYLE.get(code, UNKNOWN)


def render_rows(rows: list[str], style: Callable[[str], tuple[str, str]] = state_style) -> Text:
    """Rich text of the grid, each code drawn as `style(code)` = (glyph, colour): runs of equal cells
    share one span, so 16k cells stay cheap. Built as one string and its spans (`Text.append` would scan
    every run for control codes the glyphs never have)."""
    parts: list[str] = []
    spans: list[Span] = []
    offset = 0
    for i, row in enumerate(rows):
        if i:
            parts.append("\n")
            offset += 1
        for match in _RUNS.finditer(row):
            glyph, colour = style(match.group(1))
            run = glyph * len(match.group(0))
            parts.append(run)
            spans.append(Span(offset, offset + len(run), colour))
            offset += len(run)
    return Text("".join(parts), no_wrap=True, overflow="crop", spans=spans)


def legend(counts: dict[str, int] | None = None) -> Text:
    """The state glyphs and colours, with block counts when given."""
    text = Text(no_wrap=False)
    for state in reversed(PRIORITY):
        glyph, colour = STYLE[state]
        text.append(glyph, style=colour)
        label = state.replace("_", " ")
        text.append(f" {label} {counts.get(state, 0)}  " if counts is not None else f" {label}  ")
    return text


# ----------------------------------------------------------------- the tenant view

# Tenant colours, from the 16 ANSI ones, cycled; the glyph is the tenant's letter (OWNER_CODES), so
# the view also reads without colour.
TENANT_COLOURS = ("cyan", "yellow", "green", "magenta", "bright_blue", "bright_red", "bright_green",
                  "bright_magenta", "blue", "bright_cyan", "bright_yellow", "red")


def aggregate_owners(codes: str, per_cell: int) -> str:
    """One owner code per `per_cell` blocks: the tenant owning most of them, free ("." ) only when
    every block is free. Ties go to the tenant appearing first."""
    if per_cell <= 1:
        return codes
    cells = []
    for i in range(0, len(codes), per_cell):
        group = codes[i:i + per_cell]
        if group.count(group[0]) == len(group):  # one owner (or none) for the whole cell: most cells, counted in C
            cells.append(group[0])
            continue
        group = group.replace(NO_OWNER_CODE, "")
        cells.append(max(dict.fromkeys(group), key=group.count) if group else NO_OWNER_CODE)
    return "".join(cells)


def layout_owners(codes: str, width: int, height: int) -> BlockGrid:
    """`codes` (the decoded owner map) in at most `height` rows of `width` cells."""
    return layout(codes, width, height, merge=aggregate_owners)


def owner_style(code: str) -> tuple[str, str]:
    if code == NO_OWNER_CODE:
        return STYLE["free"]
    if code == OTHER_OWNER_CODE:
        return OTHER_OWNER_CODE, "bold white"
    index = OWNER_CODES.find(code)
    return code, f"bold {TENANT_COLOURS[index % len(TENANT_COLOURS)]}" if index >= 0 else "bold white"


def render_owner_rows(rows: list[str]) -> Text:
    return render_rows(rows, owner_style)


def owner_legend(owners: list[str], codes: str) -> Text:
    """Each tenant's letter and colour with the blocks it owns; then free blocks."""
    text = Text(no_wrap=False)
    for code, tenant in zip(OWNER_CODES, owners, strict=False):
        glyph, colour = owner_style(code)
        text.append(glyph, style=colour)
        text.append(f" {tenant} {codes.count(code)}  ")
    if OTHER_OWNER_CODE in codes:
        text.append(OTHER_OWNER_CODE, style="bold white")
        text.append(f" other tenants {codes.count(OTHER_OWNER_CODE)}  ")
    glyph, colour = STYLE["free"]
    text.append(glyph, style=colour)
    text.append(f" no owner {codes.count(NO_OWNER_CODE)}")
    return text
