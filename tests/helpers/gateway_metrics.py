"""Reading the gateway's /metrics and /stats/tenants in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample(url: str, name: str, **labels: str) -> float:
    """The value of the sample `name` with these labels in the gateway's /metrics (0 when it is absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def tenant_stats(url: str, tenant: str) -> dict:
    stats = httpx.get(f"{url}/stats/tenants", timeout=10).json()
    return next((t for t in stats["tenants"] if t["tenant"] == tenant), {})
