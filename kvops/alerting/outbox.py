"""The durable outbox: notifications and the alert state they depend on, in one SQLite file.

Every notification is a row before `Alerter.evaluate` returns (WAL, synchronous=FULL: committed
means on disk). A row is marked delivered only after its receiver answered 2xx, and a delivered
row is never sent again. The one window for a duplicate is a crash after the receiver accepted a
row and before `mark_delivered` committed: the row is sent again after the restart, with the same
`Idempotency-Key` header, so a receiver that remembers keys can drop it.

The lifecycle and group state is saved in the same transaction as the rows it produced, so after
a crash the file never says "announced as firing" without the notification that announced it.
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

SCHEMA_VERSION = 1

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
    delivered_at REAL
);
CREATE INDEX IF NOT EXISTS outbox_undelivered ON outbox (receiver, id) WHERE delivered_at IS NULL;
CREATE TABLE IF NOT EXISTS alerts (fingerprint TEXT PRIMARY KEY, alert TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alert_groups (group_key TEXT PRIMARY KEY, alert_group TEXT NOT NULL);
"""


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


@dataclass(frozen=True)
class PendingSummary:
    count: int
    oldest_created_at: float


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

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # NORMAL may lose the last commits on power loss
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(f"{path}: alert store schema {version}, this kvops understands {SCHEMA_VERSION}")
        self._db.executescript(_SCHEMA)
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
            rows = self._rows(
                "SELECT * FROM outbox WHERE receiver = ? AND delivered_at IS NULL ORDER BY id LIMIT 1", [receiver]
            )
        return rows[0] if rows else None

    def mark_delivered(self, row_id: int, now: float) -> None:
        with self._lock:
            self._db.execute("UPDATE outbox SET delivered_at = ?, last_error = NULL WHERE id = ?", (now, row_id))

    def mark_failed(self, row_id: int, attempts: int, error: str, next_attempt_at: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE outbox SET attempts = ?, last_error = ?, next_attempt_at = ? WHERE id = ?",
                (attempts, error, next_attempt_at, row_id),
            )

    def has_undelivered(self, receiver: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM outbox WHERE receiver = ? AND delivered_at IS NULL LIMIT 1", (receiver,)
            ).fetchone()
        return row is not None

    def pending(self) -> dict[str, PendingSummary]:
        with self._lock:
            rows = self._db.execute(
                "SELECT receiver, COUNT(*) AS n, MIN(created_at) AS oldest FROM outbox"
                " WHERE delivered_at IS NULL GROUP BY receiver"
            ).fetchall()
        return {r["receiver"]: PendingSummary(r["n"], r["oldest"]) for r in rows}

    def retry_now(self, now: float) -> int:
        """Make every undelivered row due: after a restart the receiver may well be back."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE outbox SET next_attempt_at = ? WHERE delivered_at IS NULL AND next_attempt_at > ?", (now, now)
            )
        return cursor.rowcount

    def prune_delivered(self, before: float) -> int:
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM outbox WHERE delivered_at IS NOT NULL AND delivered_at < ?", (before,)
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
