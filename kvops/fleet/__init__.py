"""The fleet as Prometheus sees it: every supervisor it scrapes, every engine they watch, worst first.

kvops has no aggregator of its own. Each `kvops run` exports its engines on `/metrics`, Prometheus scrapes them
all, and `kvops top --prometheus` and `kvops doctor --prometheus` read the fleet back through Prometheus's HTTP
API (`prometheus_api`), into one `Fleet` (`view`). From a row they drill down to the supervisor that watches
the engine, at the `supervisor_url` it exports on `kvops_supervisor_info`.
"""
