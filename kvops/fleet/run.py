"""`kvops top --prometheus URL`: `--once` / `--json` print the fleet; the live view alternates between the fleet
(kvops/fleet/app.py) and the supervisor of the row opened, until the fleet view is quit.

The supervisor's view is `kvops top`'s, handed in as `show_supervisor`: the fleet sits below top in the layers
(doctor reads it too), so it calls back into top rather than importing it. Textual is imported only for the live
view, so `--once`, `--json` and doctor never load it."""

from __future__ import annotations

import sys
from collections.abc import Callable

from kvops.fleet.prometheus_api import PrometheusApi, PrometheusError, parse_selector
from kvops.fleet.render import render_json, render_table
from kvops.fleet.view import read_fleet

EXIT_USAGE = 2

# kvops.top's _run_app: show one supervisor (url, admin token, interval, ..., engine to select) until it quits
ShowSupervisor = Callable[..., int]


def run_fleet(prometheus: str, selector: str | None, once: bool, as_json: bool, admin_token: str | None,
              interval_s: float, show_supervisor: ShowSupervisor) -> int:
    try:
        matchers = parse_selector(selector)
        api = PrometheusApi(prometheus)
    except PrometheusError as exc:
        print(f"kvops top: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with api:
        try:
            fleet = read_fleet(api, matchers)
        except PrometheusError as exc:
            print(f"kvops top: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if once or as_json:
            sys.stdout.write(render_json(fleet) if as_json else render_table(fleet))
            return 0
        if not sys.stdout.isatty():
            print("kvops top: the live view needs a terminal; use --once or --json in scripts", file=sys.stderr)
            return EXIT_USAGE
        from kvops.fleet.app import FleetTop, row_key

        selected: str | None = None
        while True:
            app = FleetTop(lambda: read_fleet(api, matchers), interval_s=max(interval_s, 2.0), selected=selected)
            app.sub_title = api.url + (f" {{{matchers}}}" if matchers else "")
            choice = app.run()
            if choice is None:
                return 0
            url, engine = choice
            selected = next((row_key(e) for e in (app.fleet.engines if app.fleet else [])
                             if e.supervisor.url == url and e.engine == engine), None)
            show_supervisor(url, admin_token, interval_s, engine=engine)
