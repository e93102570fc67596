"""Prometheus's HTTP query API, as the fleet view asks it: instant queries, and errors that say what to do.

A fleet view that cannot read Prometheus must say why in one line (nothing listening, an address that is not
Prometheus's, a selector Prometheus refuses), never show an empty fleet as a healthy one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

# One label matcher: name, operator, a double-quoted value with escapes (PromQL's syntax for them).
_MATCHER = re.compile(r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*')


class PrometheusError(Exception):
    """Prometheus could not be read, or refused a query: the message says what was wrong and what to do."""


@dataclass(frozen=True, slots=True)
class Sample:
    labels: dict[str, str]
    value: float


def parse_selector(text: str | None) -> str:
    """`{cluster="a", namespace=~"prod-.*"}` (braces optional) as the matchers to put inside every query's
    braces; "" for none. PrometheusError when it is not a list of label matchers."""
    inner = (text or "").strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1].strip()
    elif inner.startswith("{") or inner.endswith("}"):
        raise PrometheusError(f"--selector {text!r}: unbalanced braces; write e.g. --selector '{{cluster=\"a\"}}'")
    if not inner:
        return ""
    position = 0
    while True:
        found = _MATCHER.match(inner, position)
        if found is None:
            raise PrometheusError(f"--selector {text!r}: not a list of label matchers at {inner[position:]!r}; "
                                  "write e.g. --selector '{cluster=\"a\", namespace=~\"prod-.*\"}'")
        position = found.end()
        if position == len(inner):
            return inner
        if inner[position] != ",":
            raise PrometheusError(f"--selector {text!r}: matchers are separated by commas")
        position += 1


class PrometheusApi:
    """Instant queries against one Prometheus (`url`: its base address, e.g. http://prometheus:9090)."""

    def __init__(self, url: str, timeout_s: float = 10.0, transport: httpx.BaseTransport | None = None) -> None:
        parsed = httpx.URL(url) if "://" in url else httpx.URL(f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise PrometheusError(f"{url!r} is not an http(s) address: write e.g. --prometheus http://HOST:9090")
        self.url = str(parsed).rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)

    def __enter__(self) -> PrometheusApi:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def query(self, expr: str) -> list[Sample]:
        """The instant vector `expr` evaluates to now; NaN values (a rate over no traffic) are left out."""
        body = self._get("/api/v1/query", {"query": expr})
        data = body.get("data")
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            raise PrometheusError(f"{self.url} answered {expr!r} with no instant vector: is it Prometheus?")
        samples = []
        for item in data.get("result", []):
            value = float(item["value"][1])
            if not math.isnan(value):
                samples.append(Sample(dict(item["metric"]), value))
        return samples

    def _get(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        try:
            response = self._http.get(path, params=params)
        except httpx.TimeoutException:
            raise PrometheusError(f"Prometheus at {self.url} did not answer in time: is it overloaded? "
                                  "(--timeout waits longer)") from None
        except httpx.HTTPError as exc:
            raise PrometheusError(f"nothing answers at {self.url} ({type(exc).__name__}: {exc}): is Prometheus "
                                  "running there? Its default address is http://HOST:9090") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code == 503 and not isinstance(body, dict):
            raise PrometheusError(f"Prometheus at {self.url} is not ready yet (HTTP 503: starting, or replaying its "
                                  "write-ahead log): try again in a moment")
        if not isinstance(body, dict) or "status" not in body:
            raise PrometheusError(f"{self.url}{path} answered HTTP {response.status_code} without Prometheus's "
                                  "JSON: is that Prometheus's address (not Grafana's, or a supervisor's)?")
        if body["status"] != "success":
            raise PrometheusError(f"Prometheus refused {params.get('query', path)!r}: {body.get('error', '?')} "
                                  "(check --selector)")
        return body
