"""`kvops top`: a live, htop-like view of a supervisor (Textual), and `--once` / `--json` for scripts.

`run_top` is the CLI entry point; the app itself is only imported when it runs, so `--once` and
`--json` work without a terminal. With no supervisor to attach to, it starts one (`embedded`);
`--demo` starts one with a small engine and a mixed workload (`demo`).
"""

from __future__ import annotations

import os
import sys

from kvops.top.client import ADMIN_TOKEN_ENV, DEFAULT_URL, SupervisorClient, SupervisorUnreachable


def run_top(attach: str | None = None, once: bool = False, as_json: bool = False, admin_token: str | None = None,
            interval_s: float = 1.0, demo: bool = False) -> int:
    """`kvops top [--attach URL] [--demo] [--once] [--json] [--admin-token T]`; returns the exit status.

    Without --attach it attaches to a supervisor on the default address, or starts an embedded one
    (never for --once / --json, which only read). The admin token falls back to $KVOPS_ADMIN_TOKEN
    (needed only to apply or revert fixes)."""
    from kvops.top.render import render_json, render_once

    admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if once or as_json:
        with SupervisorClient(attach or DEFAULT_URL, admin_token=admin_token) as client:
            try:
                sys.stdout.write(render_json(client) if as_json else render_once(client))
            except SupervisorUnreachable as exc:
                print(f"kvops top: {exc}", file=sys.stderr)
                return 1
        return 0
    if not sys.stdout.isatty():
        print("kvops top: the live view needs a terminal; use --once or --json in scripts", file=sys.stderr)
        return 2

    from kvops.top.app import KvopsTop
    from kvops.top.embedded import EmbeddedSupervisor, supervisor_answers

    if demo and attach:
        print("kvops top: --demo starts its own supervisor and engine; drop --attach", file=sys.stderr)
        return 2
    embedded = None
    if demo or (attach is None and not supervisor_answers(DEFAULT_URL)):
        from kvops.top import demo as demo_setup

        embedded = EmbeddedSupervisor(demo_setup.RUN_ARGS if demo else [])
        embedded.start()
        url, admin_token = embedded.url, embedded.admin_token
        starting = f"starting {'the demo' if demo else 'a supervisor'} (pid {embedded.pid}, log {embedded.log_path})"
    else:
        url, starting = attach or DEFAULT_URL, None
    load = None
    try:
        if demo:
            load = demo_setup.DemoLoad(url)
            load.start()
        with SupervisorClient(url, admin_token=admin_token) as client:
            app = KvopsTop(client, interval_s=interval_s, starting=starting,
                           gone=embedded.exited if embedded is not None else None)
            app.sub_title = ("demo: 4 tenants; the audit-log flood starts 20 s after the engine" if demo
                             else "embedded supervisor" if embedded else url)
            app.run()
    finally:
        if load is not None:
            load.stop()
        if embedded is not None:
            print(f"kvops top: stopping the supervisor it started (log: {embedded.log_path})", file=sys.stderr)
            embedded.stop()
    return 0
