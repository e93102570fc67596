"""The fleet as Prometheus sees it: every supervisor it scrapes, every engine they watch, worst first.

kvops has no aggregator of its own. Each `kvops run` exports its engines on `/metrics`, Prometheus scrapes them
all, and `kvops top --prometheus` and `kvops doctor --prometheus` read the fleet back through Prometheus's HTTP
API (`prometheus_api`), into one `Fleet` (`view`), printed as a table or JSON (`render`, doctor's cells too).
`kvops top --prometheus` runs `run`: the live table is `app` (Textual, styled by fleet.tcss), and from a row it
drills down to the supervisor that watches the engine, at the `supervisor_url` it exports on
`kvops_supervisor_info`, through a callback into `kvops top`. Only `run`'s live view imports `app`, so doctor,
`--once` and `--json` never load Textual.
"""
