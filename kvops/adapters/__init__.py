"""Adapters: other servers' Prometheus `/metrics` (vLLM, SGLang, and a kvops engine's own scrape) read into
the one snapshot schema (`kvops.schema.snapshot`), so the rules, `kvops run`, `kvops top` and `kvops doctor`
work on them. What a server does not export stays neutral and is listed in `Snapshot.unknown`."""

from kvops.adapters.client import WatchedEngineClient
from kvops.adapters.detect import METRIC_SOURCES, detect_flavour, missing_metric, model_card, snapshot_from_scrape
from kvops.adapters.prometheus import Scrape, ScrapeError

__all__ = ["METRIC_SOURCES", "Scrape", "ScrapeError", "WatchedEngineClient", "detect_flavour", "missing_metric",
           "model_card", "snapshot_from_scrape"]
