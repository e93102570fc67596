"""The durable outbox: notifications and the alert state they depend on, in one SQLite file.

Every notification is a row before `Alerter.evaluate` returns (WAL, synchronous=FULL: committed
means on disk). A row is marked delivered only after its receiver answered 2xx, and a delivered
row is never sent again. The one window for a duplicate is a crash after the receiver accepted a
row and before `mark_delivered` committed: the row is sent again after the restart, with the same
`Idempotency-Key` header, so a receiver that remembers keys can drop it.

The lifecycle and group state is saved in the same transaction as the rows it produced, so after
a crash the file never says "announced as firing" without the notification that announced it.

A row a receiver refuses for good (a 4xx other than 408/429, twice) becomes a dead letter: it stays
in the file with the answer that killed it, and no longer counts as queued, so the receiver's later
rows go out. "Queued" below always means neither delivered nor dead.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvops.alerting.grouping import Group
from kvops.alerting.lifecycle import Alert

SCHEMA_VERSION = 2
BUSY_TIMEOUT_S = 10.0  # how long a statement waits for another process's lock before failing

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    receiver TEXT NOT NULL,
    kind TEXT NOT NULL,
    group_key TEXT NOT NULL,
    payload TEXT NOT NULL,
    idempotency_key TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    last_error TEXT,
    delivered_at REAL,
    rejections INTEGER NOT NULL DEFAULT 0,
    dead_at REAL,
    dead_status INTEGER,
    dead_reason TEXT
);
CREATE TABLE IF NOT EXISTS alerts (fingerprint TEXT PRIMARY KEY, alert TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alert_groups (group_key TEXT PRIMARY KEY, alert_group TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# after the columns exist (a version 1 file gains them first)
_INDEXES = """
DROP INDEX IF EXISTS outbox_undelivered;
CREATE INDEX IF NOT EXISTS outbox_queued ON outbox (receiver, id) WHERE delivered_at IS NULL AND dead_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (dead_at) WHERE dead_at IS NOT NULL;
"""
_V2_COLUMNS = (
    "rejections INTEGER NOT NULL DEFAULT 0",
    "dead_at REAL",
    "dead_status INTEGER",
    "dead_reason TEXT",
)
_QUEUED = "delivered_at IS NULL AND dead_at IS NULL"


# SQLite's answers that condemn the file itself; anything else (busy, locked, disk full, I/O, permissions)
# is about the moment or the machine, and must not get a good file moved aside
_DAMAGED = {"SQLITE_NOTADB", "SQLITE_CORRUPT", "SQLITE_CORRUPT_INDEX", "SQLITE_CORRUPT_SEQUENCE",
            "SQLITE_CORRUPT_VTAB", "SQLITE_SCHEMA", "SQLITE_FORMAT"}


class StateFileError(Exception):
    """The state file cannot be used. `damaged`: the file itself is bad (not SQLite, damaged, from a newer
    kvops, a directory in its place); else the machine is in the way (locked by another process, disk full)."""

    def __init__(self, message: str, damaged: bool = True) -> None:
        super().__init__(message)
        self.damaged = damaged


@dataclass(frozen=True)
class NewNotification:
    receiver: str
    kind: str  # "webhook" | "alertmanager"
    group_key: str  # for webhook rows; "" for Alertmanager pushes
    payload: str  # the exact body sent (and signed)


@dataclass(frozen=True)
class OutboxRow:
    id: int
    receiver: str
    kind: str
    group_key: str
    payload: str
    idempotency_key: str
    created_at: float
    attempts: int
    next_attempt_at: float
    last_error: str | None
    delivered_at: float | None
    rejections: int = 0  # permanent-looking refusals (4xx other than 408/429) so far
    dead_at: float | None = None
    dead_status: int | None = None
    dead_reason: str | None = None


@dataclass(frozen=True)
class PendingSummary:
    count: int
    oldest_created_at: float


@dataclass(frozen=True)
class DeadSummary:
    count: int
    last_dead_at: float
    last_reason: str


def _group_to_json(group: Group) -> str:
    return json.dumps(
        {
            "labels": group.labels,
            "next_flush_at": group.next_flush_at,
            "notified_firing": sorted(group.notified_firing),
            "last_notified_at": group.last_notified_at,
            "resolved": [a.model_dump(mode="json") for a in group.resolved.values()],
        }
    )


def _group_from_json(key: str, text: str) -> Group:
    data = json.loads(text)
    resolved = [Alert.model_validate(a) for a in data["resolved"]]
    return Group(
        key=key,
        labels=data["labels"],
        next_flush_at=data["next_flush_at"],
        notified_firing=set(data["notified_firing"]),
        last_notified_at=data["last_notified_at"],
        resolved={a.fingerprint: a for a in resolved},
    )


class Outbox:
    """One connection shared by the evaluating thread and the delivery thread, behind a lock."""

    def __init__(self, path: Path | str) -> None:
        """Open or create the file; `StateFileError` when it is not a usable alert store (see state_file.py)."""
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
        except sqlite3.Error as exc:  # a directory in its place, no permission
            raise StateFileError(f"cannot open: {exc}", damaged=self.path.is_dir()) from exc
        try:
            self._open()
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            self._db.close()
            name = getattr(exc, "sqlite_errorname", "")
            damaged = name in _DAMAGED or (name == "SQLITE_CANTOPEN" and self.path.is_dir())
            raise StateFileError(str(exc), damaged=damaged) from exc
        except StateFileError:
            self._db.close()
            raise

    def _open(self) -> None:
        self._db.row_factory = sqlite3.Row
        # read-only checks first: a file refused here is kept for a person exactly as it was found
        # (switching to WAL would already rewrite its header). A torn or truncated file can open and read
        # its first page fine: look at every page once, now, rather than fail at the first commit.
        problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise StateFileError(f"integrity check failed: {'; '.join(problems[:3])}")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            raise StateFileError(f"alert store schema {version}, this kvops understands {SCHEMA_VERSION}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # NORMAL may lose the last commits on power loss
        self._db.executescript(_SCHEMA)
        if version == 1:
            # column by column, skipping any a crash mid-upgrade already added
            present = {r["name"] for r in self._db.execute("PRAGMA table_info(outbox)")}
            for column in _V2_COLUMNS:
                if column.split()[0] not in present:
                    self._db.execute(f"ALTER TABLE outbox ADD COLUMN {column}")
        self._db.executescript(_INDEXES)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def load_state(self) -> tuple[list[Alert], list[Group]]:
        with self._lock:
            alerts = [Alert.model_validate_json(r["alert"]) for r in self._db.execute("SELECT alert FROM alerts")]
            groups = [
                _group_from_json(r["group_key"], r["alert_group"])
                for r in self._db.execute("SELECT group_key, alert_group FROM alert_groups")
            ]
        return alerts, groups

    def save(
        self, alerts: Iterable[Alert], groups: Iterable[Group], notifications: Iterable[NewNotification], now: float
    ) -> list[OutboxRow]:
        """Replace the alert state and enqueue notifications, atomically; returns the new rows."""
        alert_rows = [(a.fingerprint, a.model_dump_json()) for a in alerts]
        group_rows = [(g.key, _group_to_json(g)) for g in groups]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM alerts")
                self._db.executemany("INSERT INTO alerts (fingerprint, alert) VALUES (?, ?)", alert_rows)
                self._db.execute("DELETE FROM alert_groups")
                self._db.executemany("INSERT INTO alert_groups (group_key, alert_group) VALUES (?, ?)", group_rows)
                new_ids = []
                for n in notifications:
                    cursor = self._db.execute(
                        "INSERT INTO outbox (receiver, kind, group_key, payload, idempotency_key, created_at,"
                        " next_attempt_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (n.receiver, n.kind, n.group_key, n.payload, uuid.uuid4().hex, now, now),
                    )
                    new_ids.append(cursor.lastrowid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            if not new_ids:
                return []
            marks = ",".join("?" * len(new_ids))
            return self._rows(f"SELECT * FROM outbox WHERE id IN ({marks}) ORDER BY id", new_ids)

    def head(self, receiver: str) -> OutboxRow | None:
        """The oldest undelivered row: rows of one receiver go out strictly in order."""
        with self._lock:
            rows = self._rows(f"SELECT * FROM outbox WHERE receiver = ? AND {_QUEUED} ORDER BY id LIMIT 1", [receiver])
        return rows[0] if rows else None

    def mark_delivered(self, row_id: int, now: float) -> None:
        with self._lock:
            self._db.execute("UPDATE outbox SET delivered_at = ?, last_error = NULL WHERE id = ?", (now, row_id))

    def mark_failed(
        self, row_id: int, attempts: int, error: str, next_attempt_at: float, rejections: int | None = None
    ) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE outbox SET attempts = ?, last_error = ?, next_attempt_at = ?,"
                " rejections = COALESCE(?, rejections) WHERE id = ?",
                (attempts, error, next_attempt_at, rejections, row_id),
            )

    def mark_dead(self, row_id: int, attempts: int, status: int | None, reason: str, now: float) -> None:
        """Out of the receiver's queue for good, kept for a person (GET /api/alerts/dead-letters)."""
        with self._lock:
            self._db.execute(
                "UPDATE outbox SET attempts = ?, last_error = ?, rejections = rejections + 1, dead_at = ?,"
                " dead_status = ?, dead_reason = ? WHERE id = ?",
                (attempts, reason, now, status, reason, row_id),
            )

    def dead_letters(self, limit: int = 100) -> list[OutboxRow]:
        """Most recent first."""
        with self._lock:
            return self._rows("SELECT * FROM outbox WHERE dead_at IS NOT NULL ORDER BY dead_at DESC, id DESC LIMIT ?",
                              [limit])

    def dead_since(self, since: float) -> dict[str, DeadSummary]:
        """Per receiver: dead letters since `since`, and the latest one's reason."""
        with self._lock:
            rows = self._db.execute(
                "SELECT receiver, COUNT(*) AS n, MAX(dead_at) AS last FROM outbox WHERE dead_at >= ?"
                " GROUP BY receiver", (since,)
            ).fetchall()
            summaries = {}
            for r in rows:
                reason = self._db.execute(
                    "SELECT dead_reason FROM outbox WHERE receiver = ? AND dead_at = ? ORDER BY id DESC LIMIT 1",
                    (r["receiver"], r["last"]),
                ).fetchone()
                summaries[r["receiver"]] = DeadSummary(r["n"], r["last"], reason[0] if reason else "")
        return summaries

    def dead_groups(self, receiver: str) -> list[str]:
        """Webhook groups whose latest notification to `receiver` is a dead letter: what it missed."""
        with self._lock:
            rows = self._db.execute(
                "SELECT o.group_key FROM outbox o WHERE o.receiver = ? AND o.kind = 'webhook' AND o.group_key != ''"
                " AND o.dead_at IS NOT NULL AND o.id = (SELECT MAX(id) FROM outbox i"
                " WHERE i.receiver = o.receiver AND i.group_key = o.group_key) ORDER BY o.id",
                (receiver,),
            ).fetchall()
        return [r[0] for r in rows]

    def last_delivered(self) -> dict[str, float]:
        """Per receiver, the latest delivery still in the file (within the retention)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT receiver, MAX(delivered_at) FROM outbox WHERE delivered_at IS NOT NULL GROUP BY receiver"
            ).fetchall()
        return {r[0]: r[1] for r in rows}

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def has_undelivered(self, receiver: str) -> bool:
        with self._lock:
            row = self._db.execute(
                f"SELECT 1 FROM outbox WHERE receiver = ? AND {_QUEUED} LIMIT 1", (receiver,)
            ).fetchone()
        return row is not None

    def pending(self) -> dict[str, PendingSummary]:
        with self._lock:
            rows = self._db.execute(
                "SELECT receiver, COUNT(*) AS n, MIN(created_at) AS oldest FROM outbox"
                f" WHERE {_QUEUED} GROUP BY receiver"
            ).fetchall()
        return {r["receiver"]: PendingSummary(r["n"], r["oldest"]) for r in rows}

    def retry_now(self, now: float) -> int:
        """Make every undelivered row due: after a restart the receiver may well be back."""
        with self._lock:
            cursor = self._db.execute(
                f"UPDATE outbox SET next_attempt_at = ? WHERE {_QUEUED} AND next_attempt_at > ?", (now, now)
            )
        return cursor.rowcount

    def prune_delivered(self, before: float) -> int:
        """Delivered rows and dead letters older than `before`; queued rows are never pruned."""
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM outbox WHERE (delivered_at IS NOT NULL AND delivered_at < ?)"
                " OR (dead_at IS NOT NULL AND dead_at < ?)", (before, before)
            )
        return cursor.rowcount

    def rows(self, receiver: str | None = None) -> list[OutboxRow]:
        """Every row, oldest first (for inspection and tests)."""
        with self._lock:
            if receiver is None:
                return self._rows("SELECT * FROM outbox ORDER BY id", [])
            return self._rows("SELECT * FROM outbox WHERE receiver = ? ORDER BY id", [receiver])

    def _rows(self, sql: str, params: list[object]) -> list[OutboxRow]:
        return [OutboxRow(**dict(r)) for r in self._db.execute(sql, params)]
