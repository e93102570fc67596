"""Snapshot tests (pytest-textual-snapshot) of `kvops top`'s main screens in a fixed state.

The state is `FakeSupervisor`'s synthetic engines at fixed times, shown in UTC. The reference
SVGs are in tests/__snapshots__/; after an intended change to the screen, look at the report
pytest writes and update them with `pytest tests/test_top_snapshots.py --snapshot-update`.
They are tied to the Textual version pinned in the test extras.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvops.schema.snapshot import encode_owner_map
from kvops.top.app import KvopsTop
from tests.helpers.fake_supervisor import FakeSupervisor

SIZE = (160, 50)


pytestmark = pytest.mark.usefixtures("utc")  # the clock the screens show: tests/conftest.py


def app() -> KvopsTop:
    fake = FakeSupervisor()
    owners = ["alice"] * 300 + [None] * 200 + ["bob"] * 100 + ["carol"] * 210 + [None] * 214
    encoded, names = encode_owner_map(owners)
    for snap in fake.snaps["gpu-a"]:
        snap.blocks.owner_map, snap.blocks.owners = encoded, names
    return KvopsTop(fake, interval_s=3600)


async def settled(pilot: Any) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_main_screen(snap_compare: Any) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled)


def test_tenant_view_of_the_block_map(snap_compare: Any) -> None:
    async def before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("t")

    assert snap_compare(app(), terminal_size=SIZE, run_before=before)


def test_diagnosis_detail(snap_compare: Any) -> None:
    async def before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("tab", "tab", "enter")

    assert snap_compare(app(), terminal_size=SIZE, run_before=before)


def test_help(snap_compare: Any) -> None:
    async def before(pilot: Any) -> None:
        await settled(pilot)
        await pilot.press("question_mark")

    assert snap_compare(app(), terminal_size=SIZE, run_before=before)
