"""`kvops bench events` on a small recording built here: the report's structure and counts (never its timings),
the renumbered repeats, the memory probe, and clear errors for bad recordings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvops.bench.events import load_batches, repeat_payloads, vllm_payload
from kvops.bench.events_memory import memory_probe, synthetic_batches
from kvops.cli import main
from kvops.events.recording import Frame, write_recording
from kvops.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch


def stored(hashes: list[int], parent: int | None = None, extra: list[object] | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[h * 10 + k for h in hashes
                                                                                 for k in range(4)],
                       block_size=4, medium="GPU", extra_keys=extra)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


# Per repeat: 6 events (the clear is left out), 7 blocks stored, 2 removed, 5 left resident.
STREAM = [
    (100.0, [AllBlocksCleared(), stored([1, 2, 3]), stored([4], parent=3)]),
    (101.0, [removed(4), removed(3), stored([5], parent=2)]),
    (102.0, [stored([6, 7], extra=[["tenant-a"], None])]),
]


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "small.kvev"
    write_recording(path, (Frame(ts + 0.01, seq, vllm_payload(ts, events)) for seq, (ts, events) in enumerate(STREAM)))
    return path


def test_the_report_counts_every_repeat(recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = main(["bench", "events", "--recording", str(recording), "--repeat", "3", "--memory-blocks", "0",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    replay = report["replay"]
    assert (report["repeat"], report["recordings"], report["memory"]) == (3, [str(recording)], [])
    assert (replay["batches"], replay["events"], replay["blocks_stored"], replay["blocks_removed"]) == (9, 18, 21, 6)
    assert replay["resident_blocks"] == 15  # the repeats' hashes are new: each adds its 5
    for rate in ("decode_apply_events_per_s", "apply_events_per_s", "decode_apply_events_per_wall_s"):
        assert isinstance(replay[rate], int) and replay[rate] > 0
    assert replay["stats_ms"] >= 0 and report["cpu"] and report["command"].startswith("kvops bench events")
    table = capsys.readouterr().out
    assert "decode + apply, events/CPU s" in table and "resident blocks at the end" in table


def test_each_repeat_is_a_new_stream_later_in_time(recording: Path) -> None:
    batches = load_batches([recording])
    first, second = ([decode_batch(p) for p in repeat_payloads(batches, n, span_s=10.0)] for n in (0, 1))
    assert [b.ts for b in second] == [b.ts + 10.0 for b in first]
    assert all(type(e) is not AllBlocksCleared for b in first + second for e in b.events)
    a, b = first[0].events[0], second[0].events[0]
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert a.block_hashes == [1, 2, 3] and not set(a.block_hashes) & set(b.block_hashes)
    assert b.token_ids != a.token_ids and len(b.token_ids) == len(a.token_ids)
    child = second[0].events[1]
    assert isinstance(child, BlockStored) and child.parent_block_hash == b.block_hashes[-1]


def test_the_memory_probe_fills_the_blocks_asked(tmp_path: Path, recording: Path) -> None:
    batches = list(synthetic_batches(700, tenants=2))
    stores = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stores) == 700
    assert {e.extra_keys[0][0] for e in stores if e.extra_keys} == {"tenant-0", "tenant-1"}
    assert all(len(h) == 32 for e in stores for h in e.block_hashes)
    probe = memory_probe(700, tenants=2)
    assert (probe["resident_blocks"], probe["tenants"], probe["traced_bytes_per_block"]) == (700, 2, None)
    assert probe["stats_ms"] >= 0
    # The whole command once, probes in their own processes (RSS is only a process's own in a fresh one).
    out = tmp_path / "report.json"
    assert main(["bench", "events", "--recording", str(recording), "--repeat", "1", "--memory-blocks", "300",
                 "--json", str(out)]) == 0
    memory = json.loads(out.read_text())["memory"]
    assert [(m["tenants"], m["resident_blocks"]) for m in memory] == [(1, 300), (2, 300)]


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such recording"),
    (b"\x00\x01", "truncated"),
    (b"folder", "has no .kvev recording"),
    (b"", "the recordings are empty"),
])
def test_a_bad_recording_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None,
                                          message: str) -> None:
    path = tmp_path / "bad.kvev"
    if content == b"folder":
        path = tmp_path / "empty"
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    assert main(["bench", "events", "--recording", str(path), "--memory-blocks", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvops bench events: error:") and message in err and "Traceback" not in err


def test_a_frame_that_is_not_an_event_batch_is_a_clear_error(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "other.kvev"
    write_recording(path, [Frame(1.0, 0, b"\xc1 not msgpack")])
    assert main(["bench", "events", "--recording", str(path), "--memory-blocks", "0"]) == 2
    assert "not a KV event batch" in capsys.readouterr().err
