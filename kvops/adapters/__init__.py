"""Adapters: what every kind of server shares when kvops reads it: a Prometheus scrape (`prometheus.py`), metric
names across versions (`names.py`), the neutral snapshot and histogram percentiles (`common.py`), a kvops
engine's own scrape (`kvops_metrics.py`), the HTTP clients (`engine_client.py`) and the plausibility checks.
What each kind exports, and how to read it, is its module in kvops.kinds, the layer above. What a server does
not export stays neutral and is listed in `Snapshot.unknown`."""

from kvops.adapters.prometheus import Scrape, ScrapeError

__all__ = ["Scrape", "ScrapeError"]
