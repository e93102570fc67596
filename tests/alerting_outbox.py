"""What the alerter wrote to its outbox, read back the way a restarted daemon would (shared by the
alerting tests)."""

from __future__ import annotations

from pathlib import Path

from kvops.alerting.alerter import STATE_FILE
from kvops.alerting.outbox import Outbox, OutboxRow


def outbox_rows(state_dir: Path) -> list[OutboxRow]:
    outbox = Outbox(state_dir / STATE_FILE)
    try:
        return outbox.rows()
    finally:
        outbox.close()
