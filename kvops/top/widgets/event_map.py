"""The block map of a vLLM read through its KV cache events (Snapshot.kv_events), and the events' numbers below it.

kvops's own engine reports every block's state; a vLLM reports none, but its events tell which blocks are
resident, since when, for which tenant and on which medium. The map draws those blocks, grouped by age class
(youngest first), by tenant (a cache salt or LoRA, one letter each) or by medium, then the pool's free blocks
(pool size minus resident; not drawn while the pool size is unknown). `t` cycles the three views. Cells are laid
out by kvops.top.block_grid; a cell covering several blocks shows the group most of them belong to.

`EventStats` is the text under the map: the stream's health, rates, re-stores, lifetimes and shared prefixes
(kvops.top.render.kv_event_lines, which `--once` prints too).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from rich.text import Text

from kvops.schema.kv_events import NO_TENANT, KvEventStats
from kvops.schema.snapshot import (
    NO_OWNER_CODE,
    OTHER_OWNER_CODE,
    OWNER_CODES,
    BlockStats,
    Snapshot,
    decode_block_map,
)
from kvops.top import block_grid as grids
from kvops.top.client import EngineView
from kvops.top.render import OFFLOAD_MEDIA, free_blocks, kv_event_lines, pool_line
from kvops.top.widgets.common import Readout

EVENT_VIEWS = ("age", "tenants", "medium")

# Age classes, youngest first: a glyph that reads without colour and a colour from the 16 ANSI ones, going from
# fresh green to old red. Classes past the last style share it.
AGE_STYLES = (("█", "bright_green"), ("▓", "green"), ("▒", "yellow"), ("░", "bright_red"), ("▪", "red"))
MEDIUM_STYLES = {"GPU": ("█", "green"), "CPU": ("▒", "cyan"), "STORAGE": ("░", "magenta")}
OTHER_MEDIUM = ("?", "white")
FREE = grids.STYLE["free"]
# Codes are one character per block: a digit per age class or medium (so at most 10), "." for free.
_DIGITS = "0123456789"

Style = Callable[[str], tuple[str, str]]


def _short(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:g}s"
    return f"{seconds / 60:g}m" if seconds < 3600 else f"{seconds / 3600:g}h"


def age_labels(bounds: list[float]) -> list[str]:
    """One label per age class: "<10s", "10s-1m", ..., ">30m"."""
    if not bounds:
        return ["any age"]
    labels = [f"<{_short(bounds[0])}"]
    labels += [f"{_short(lo)}-{_short(hi)}" for lo, hi in itertools.pairwise(bounds)]
    return [*labels, f">{_short(bounds[-1])}"]


def _age_style(code: str) -> tuple[str, str]:
    if code == NO_OWNER_CODE:
        return FREE
    return AGE_STYLES[min(_DIGITS.index(code), len(AGE_STYLES) - 1)]


def _free(ev: KvEventStats) -> str:
    return NO_OWNER_CODE * (free_blocks(ev) or 0)


def age_codes(ev: KvEventStats) -> str:
    return "".join(_DIGITS[min(i, 9)] * n for i, n in enumerate(ev.resident_by_age)) + _free(ev)


def age_legend(ev: KvEventStats) -> Text:
    text = Text()
    for i, (label, n) in enumerate(zip(age_labels(ev.age_bounds_s), ev.resident_by_age, strict=False)):
        glyph, colour = _age_style(_DIGITS[min(i, 9)])
        text.append(glyph, style=colour)
        text.append(f" {label} {n}  ")
    return text


def _media(ev: KvEventStats) -> list[str]:
    """The media with resident blocks, the GPU pool's first (its free blocks follow them on the map)."""
    return sorted((m for m, n in ev.resident.items() if n > 0), key=lambda m: (m.upper() in OFFLOAD_MEDIA, m))[:10]


def medium_codes(ev: KvEventStats) -> str:
    media = _media(ev)
    pool = "".join(_DIGITS[i] * ev.resident[m] for i, m in enumerate(media) if m.upper() not in OFFLOAD_MEDIA)
    offload = "".join(_DIGITS[i] * ev.resident[m] for i, m in enumerate(media) if m.upper() in OFFLOAD_MEDIA)
    return pool + _free(ev) + offload


def _medium_style(ev: KvEventStats) -> Style:
    media = _media(ev)

    def style(code: str) -> tuple[str, str]:
        if code == NO_OWNER_CODE:
            return FREE
        return MEDIUM_STYLES.get(media[_DIGITS.index(code)].upper(), OTHER_MEDIUM)

    return style


def medium_legend(ev: KvEventStats) -> Text:
    text = Text()
    style = _medium_style(ev)
    for i, medium in enumerate(_media(ev)):
        glyph, colour = style(_DIGITS[i])
        text.append(glyph, style=colour)
        text.append(f" {medium} {ev.resident[medium]}  ")
    return text


def tenant_codes(ev: KvEventStats, blocks: BlockStats) -> tuple[str, list[str]]:
    """One tenant letter per block and the tenants in letter order: the snapshot's owner map where the index
    filled it (blocks in age order), else each tenant's resident blocks in one run, most blocks first."""
    if blocks.owner_map:
        return decode_block_map(blocks.owner_map), list(blocks.owners)
    tenants = sorted(((name, t.resident) for name, t in ev.tenants.items() if t.resident > 0),
                     key=lambda kv: (-kv[1], kv[0]))
    codes = "".join((OWNER_CODES[i] if i < len(OWNER_CODES) else OTHER_OWNER_CODE) * n
                    for i, (_, n) in enumerate(tenants))
    return codes + _free(ev), [name for name, _ in tenants[:len(OWNER_CODES)]]


def tenant_legend(owners: list[str], codes: str) -> Text:
    """Each tenant's letter and colour with its resident blocks (NO_TENANT: neither salt nor LoRA)."""
    text = Text()
    for code, tenant in zip(OWNER_CODES, owners, strict=False):
        glyph, colour = grids.owner_style(code)
        text.append(glyph, style=colour)
        text.append(f" {'(no salt or LoRA)' if tenant == NO_TENANT else tenant} {codes.count(code)}  ")
    if OTHER_OWNER_CODE in codes:
        text.append(OTHER_OWNER_CODE, style="bold white")
        text.append(f" other tenants {codes.count(OTHER_OWNER_CODE)}  ")
    return text


def draw(ev: KvEventStats, blocks: BlockStats, view: str, width: int, height: int) -> tuple[Text, Text]:
    """The map of view `view` (one of EVENT_VIEWS) in `width` x `height` cells, and its legend."""
    style: Style
    if view == "tenants":
        codes, owners = tenant_codes(ev, blocks)
        style, legend = grids.owner_style, tenant_legend(owners, codes)
    elif view == "medium":
        codes, style, legend = medium_codes(ev), _medium_style(ev), medium_legend(ev)
    else:
        codes, style, legend = age_codes(ev), _age_style, age_legend(ev)
    glyph, colour = FREE
    legend.append(glyph, style=colour)
    legend.append(f" free {free_blocks(ev) if ev.pool_blocks is not None else '?'}")
    if not codes:
        return Text("no resident blocks yet, and the pool size is unknown", style="dim"), legend
    grid = grids.layout(codes, width, height, merge=grids.aggregate_owners)
    legend.append(f"\n{grid.scale} ({grid.total_blocks} blocks)  {pool_line(ev)}", style="dim")
    return grids.render_rows(grid.rows, style), legend


def stats_text(history: Sequence[Snapshot]) -> Text:
    """The events' numbers of the latest snapshot in `history` (oldest first), a stale stream in the warning
    colour and a broken one in the error colour."""
    text = Text("\n".join(kv_event_lines(history)))
    text.highlight_words(["STALE"], style="bold yellow")
    text.highlight_regex(r"stream error: .*", style="bold red")
    return text


class EventStats(Readout):
    """The events' numbers under the map; empty (and hidden by top.tcss) for an engine without events."""

    def __init__(self) -> None:
        super().__init__(id="event-stats")

    def show_engine(self, view: EngineView | None) -> None:
        latest = view.latest if view is not None else None
        if view is None or latest is None or latest.kv_events is None:
            self.show("")
            return
        self.show(stats_text(view.history or [latest]))
