"""`kvops top`: a live, htop-like view of a supervisor (Textual), and `--once` / `--json` for scripts.

`run_top` is the CLI entry point; the app itself is only imported when it runs, so `--once` and
`--json` work without a terminal.
"""

from __future__ import annotations

import os
import sys

from kvops.top.client import ADMIN_TOKEN_ENV, DEFAULT_URL, SupervisorClient, SupervisorUnreachable


def run_top(attach: str = DEFAULT_URL, once: bool = False, as_json: bool = False, admin_token: str | None = None,
            interval_s: float = 1.0) -> int:
    """`kvops top [--attach URL] [--once] [--json] [--admin-token T]`; returns the exit status.
    The admin token falls back to $KVOPS_ADMIN_TOKEN (needed only to apply or revert fixes)."""
    from kvops.top.render import render_json, render_once

    client = SupervisorClient(attach, admin_token=admin_token or os.environ.get(ADMIN_TOKEN_ENV))
    try:
        if once or as_json:
            try:
                sys.stdout.write(render_json(client) if as_json else render_once(client))
            except SupervisorUnreachable as exc:
                print(f"kvops top: {exc}", file=sys.stderr)
                return 1
            return 0
        from kvops.top.app import KvopsTop

        KvopsTop(client, interval_s=interval_s).run()
        return 0
    finally:
        client.close()
