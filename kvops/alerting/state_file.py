"""Opening `alerts.sqlite3`, and what happens when it cannot be used.

A damaged state file must not keep the supervisor down: the engines still need watching, and an
alerter with empty state is far better than none. So an unusable file (not SQLite, damaged, from a
newer kvops, a directory in its place) is moved aside as `alerts.sqlite3.corrupt-<UTC time>`, never
deleted, because its undelivered notifications may still matter to a person, and a fresh file is
created. The reset is recorded in the new file's `meta` table, so the `alert_state_reset` alert
survives a restart within its hold period, and the alerter raises it as a critical diagnosis.
A file that is fine but cannot be opened now (locked by another process, disk full) stays where it
is, and the alerter runs on memory, which the same alert says.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
from pydantic import ValidationError

from kvops.alerting.grouping import Group
from kvops.alerting.lifecycle import Alert
from kvops.alerting.outbox import Outbox, StateFileError

log = structlog.get_logger("kvops.alerting")

_RESET_KEY = "state_reset"
# next to the database, SQLite's own files: they belong to the old database and move with it
_SIDECARS = ("-wal", "-shm", "-journal")


@dataclass(frozen=True)
class StateReset:
    """The last time the state file had to be replaced."""

    at: float
    reason: str
    moved_to: str  # where the old file went ("" when it could not be moved)
    durable: bool = True  # False: the fresh state lives in memory only (the directory refused the move)


@dataclass
class OpenedState:
    outbox: Outbox
    alerts: list[Alert]
    groups: list[Group]
    reset: StateReset | None


def open_state(path: Path, now: float) -> OpenedState:
    """The outbox at `path` with its alert state; an unusable file is moved aside and replaced (see above)."""
    try:
        return _open(path)
    except (StateFileError, ValidationError, ValueError, KeyError, TypeError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        damaged = not isinstance(exc, StateFileError) or exc.damaged
    # a file that is fine but cannot be opened now (locked by another kvops, disk full) stays where it is
    moved_to = _move_aside(path, now) if damaged else None
    outbox: Outbox | None = None
    if moved_to is not None:
        try:
            outbox = Outbox(path)
        except StateFileError as exc:
            log.error("could not create a fresh alert state file", path=str(path), error=str(exc))
    if outbox is None:
        # no room for a durable file: run on memory rather than not at all, and say so in the alert
        outbox = Outbox(":memory:")
        log.error("alert state file unusable; alert state is kept in memory only until this is fixed",
                  path=str(path), moved_to=moved_to, reason=reason)
    else:
        log.error("alert state file unusable; moved aside and started afresh (undelivered notifications in it "
                  "were not sent; alerts already announced will be announced again)", path=str(path),
                  moved_to=moved_to, reason=reason)
    durable = outbox.path != Path(":memory:")
    reset = StateReset(at=now, reason=reason, moved_to=moved_to or "", durable=durable)
    outbox.set_meta(_RESET_KEY, json.dumps(asdict(reset)))
    return OpenedState(outbox, [], [], reset)


def _open(path: Path) -> OpenedState:
    outbox = Outbox(path)
    try:
        alerts, groups = outbox.load_state()
        raw = outbox.get_meta(_RESET_KEY)
        reset = StateReset(**json.loads(raw)) if raw is not None else None
    except BaseException:
        outbox.close()
        raise
    return OpenedState(outbox, alerts, groups, reset)


def corrupt_name(path: Path, now: float) -> Path:
    stamp = dt.datetime.fromtimestamp(now, tz=dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    candidate = path.with_name(f"{path.name}.corrupt-{stamp}")
    serial = 1
    while candidate.exists() or any(Path(f"{candidate}{s}").exists() for s in _SIDECARS):
        serial += 1  # two resets within a second: never overwrite the first one's file
        candidate = path.with_name(f"{path.name}.corrupt-{stamp}-{serial}")
    return candidate


def _move_aside(path: Path, now: float) -> str | None:
    target = corrupt_name(path, now)
    try:
        if path.exists() or path.is_symlink():
            os.rename(path, target)
        for suffix in _SIDECARS:
            sidecar = Path(f"{path}{suffix}")
            if sidecar.exists():
                os.rename(sidecar, Path(f"{target}{suffix}"))
    except OSError as exc:
        log.error("could not move the unusable alert state file aside", path=str(path), error=str(exc))
        return None
    return str(target)
