"""`kvops top`: a live, htop-like view of a supervisor (Textual), and `--once` / `--json` for scripts.

`run_top` is the CLI entry point; the app itself is only imported when it runs, so `--once` and
`--json` work without a terminal. It shows a supervisor that answers (`--attach URL`, else
$KVOPS_TOP_URL, else 127.0.0.1:9400) and starts processes only when asked to: `--start` runs a
supervisor and engine for the session (`embedded`), `--demo` also a mixed workload (`demo`). With
nothing answering and neither flag it says how to get a supervisor, and exits 2.

`--prometheus URL [--selector '{...}']` shows the fleet instead: every engine of every supervisor that Prometheus
scrapes, worst first (kvops.fleet.run, handed `_run_app`), and opens a row's supervisor as `--attach` would.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from kvops.top.client import (
    ADMIN_TOKEN_ENV,
    DEFAULT_URL,
    URL_ENV,
    SupervisorClient,
    SupervisorUnreachable,
    normalize_url,
    probe,
)

if TYPE_CHECKING:
    from kvops.top.embedded import EmbeddedSupervisor

EXIT_USAGE = 2  # nothing to show (no supervisor, no terminal) or flags that do not go together


def default_url() -> tuple[str, str]:
    """The supervisor to show without --attach, and where that address came from (for messages)."""
    if os.environ.get(URL_ENV):
        return os.environ[URL_ENV], f"That address comes from ${URL_ENV}; --attach URL names another."
    return DEFAULT_URL, f"That is the default address; --attach URL or ${URL_ENV} names another."


def no_supervisor_message(url: str, why: str, source: str | None = None) -> str:
    """What `kvops top` says when nothing answers: the ways to get a supervisor to show. `source`
    says where the address came from when the user did not give it with --attach."""
    where = f"{source}\n" if source else ""
    return (f"kvops top: no kvops supervisor answers at {url} ({why}).\n{where}"
            "To get one:\n"
            "  kvops run                  start a supervisor and its engines (in another terminal), then kvops top\n"
            "  kvops top --attach URL     show a supervisor running elsewhere\n"
            "  kvops top --demo           start a demo engine and workload for this session\n"
            "  kvops top --start          start a supervisor and engine for this session\n")


def _conflict(attach: str | None, once: bool, as_json: bool, demo: bool, start: bool,
              prometheus: str | None = None, selector: str | None = None) -> str | None:
    """Why these flags do not go together, or None."""
    starts = "--demo" if demo else "--start" if start else None
    if prometheus and (attach or starts):
        return f"--prometheus shows the fleet Prometheus scrapes; drop {'--attach' if attach else starts}"
    if selector and not prometheus:
        return "--selector picks engines of the fleet: give --prometheus URL too"
    if demo and start:
        return "--demo already starts a supervisor and engine; drop --start"
    if starts and attach:
        return f"{starts} starts its own supervisor and engine; drop --attach"
    if starts and (once or as_json):
        return f"{starts} is for the live view: --once and --json only read a running supervisor"
    return None


def run_top(attach: str | None = None, once: bool = False, as_json: bool = False, admin_token: str | None = None,
            interval_s: float = 1.0, demo: bool = False, start: bool = False, prometheus: str | None = None,
            selector: str | None = None) -> int:
    """`kvops top [--attach URL | --prometheus URL [--selector S]] [--demo | --start] [--once] [--json]
    [--admin-token T]`; returns the exit status.

    Nothing is started unless --demo or --start says so. The admin token falls back to
    $KVOPS_ADMIN_TOKEN (needed only to apply or revert fixes)."""
    conflict = _conflict(attach, once, as_json, demo, start, prometheus, selector)
    if conflict is not None:
        print(f"kvops top: {conflict}", file=sys.stderr)
        return EXIT_USAGE
    admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if prometheus:
        from kvops.fleet.run import run_fleet

        return run_fleet(prometheus, selector, once, as_json, admin_token, interval_s, _run_app)
    url, source = (attach, None) if attach else default_url()
    if not (demo or start):
        why = probe(url)
        if why is not None:
            print(no_supervisor_message(normalize_url(url), why, source),
                  end="", file=sys.stderr)
            return EXIT_USAGE
    if once or as_json:
        return _print_once(url, as_json, admin_token)
    if not sys.stdout.isatty():
        print("kvops top: the live view needs a terminal; use --once or --json in scripts", file=sys.stderr)
        return EXIT_USAGE
    if demo or start:
        return _run_embedded(demo, interval_s)
    return _run_app(url, admin_token, interval_s)


def _print_once(url: str, as_json: bool, admin_token: str | None) -> int:
    from kvops.top.render import render_json, render_once

    with SupervisorClient(url, admin_token=admin_token) as client:
        try:
            sys.stdout.write(render_json(client) if as_json else render_once(client))
        except SupervisorUnreachable as exc:  # it answered /health, then failed: a different kind of trouble
            print(f"kvops top: {exc}", file=sys.stderr)
            return 1
    return 0


def _run_app(url: str, admin_token: str | None, interval_s: float, starting: str | None = None,
             embedded: EmbeddedSupervisor | None = None, demo: bool = False, engine: str | None = None) -> int:
    from kvops.top.app import KvopsTop

    gone = embedded.exited if embedded is not None else None
    with SupervisorClient(url, admin_token=admin_token) as client:
        app = KvopsTop(client, interval_s=interval_s, starting=starting, gone=gone)
        app.selected_engine = engine  # opened from the fleet on this engine; the first engine otherwise
        app.sub_title = ("demo: 4 tenants; the audit-log flood starts 20 s after the engine" if demo
                         else "embedded supervisor" if embedded is not None else client.url)
        app.run()
    return 0


def _run_embedded(demo: bool, interval_s: float) -> int:
    """`--demo` / `--start`: a supervisor (and, for the demo, a workload) for the session, stopped on exit."""
    from kvops.top import demo as demo_setup
    from kvops.top.embedded import EmbeddedSupervisor

    embedded = EmbeddedSupervisor(demo_setup.RUN_ARGS if demo else [])
    embedded.start()
    starting = f"starting {'the demo' if demo else 'a supervisor'} (pid {embedded.pid}, log {embedded.log_path})"
    load = None
    try:
        if demo:
            load = demo_setup.DemoLoad(embedded.url)
            load.start()
        return _run_app(embedded.url, embedded.admin_token, interval_s, starting, embedded, demo)
    finally:
        if load is not None:
            load.stop()
        print(f"kvops top: stopping the supervisor it started (log: {embedded.log_path})", file=sys.stderr)
        embedded.stop()
