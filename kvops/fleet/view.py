"""The fleet read from Prometheus: one row per engine, its supervisor's state, its worst diagnosis, worst first.

Every series of a supervisor carries the target labels Prometheus gives it (`job`, `instance`, and whatever the
scrape config adds); an engine is (job, instance, engine). A supervisor Prometheus can no longer scrape
(`up == 0`) keeps its engines on the list, read from their last hour of samples and marked as such: an engine
nobody watches is not a healthy one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvops.fleet.prometheus_api import PrometheusApi, Sample

SUPERVISOR_JOB = "kvops-supervisor"  # the job name the documented scrape configs give the supervisors
RATE_WINDOW = "5m"  # as the Grafana dashboard's panels
LOOKBACK = "1h"  # how long the engines of a supervisor that stopped answering stay on the list
SEVERITY_RANK = {"critical": 2, "warning": 3, "info": 4}

Target = tuple[str, str]  # (job, instance)
EngineKey = tuple[str, str, str]  # (job, instance, engine)


@dataclass(slots=True)
class Supervisor:
    job: str
    instance: str
    up: bool
    url: str  # where its API answers: drill down there
    version: str = ""


@dataclass(slots=True)
class FleetDiagnosis:
    rule: str
    severity: str
    subjects: int  # how many (tenants, layers, ...) it fires for


@dataclass(slots=True)
class FleetEngine:
    engine: str
    kind: str
    supervisor: Supervisor
    up: bool | None  # None: unknown now, its supervisor is not answering
    diagnoses: list[FleetDiagnosis] = field(default_factory=list)
    kv_usage: float | None = None
    hit_rate: float | None = None
    waiting: float | None = None
    running: float | None = None
    tokens_per_s: float | None = None

    @property
    def status(self) -> str:
        """The worst thing about the engine, in a word or two."""
        if not self.supervisor.up:
            return "supervisor down"
        if not self.up:
            return "engine down"
        worst = self.worst
        return worst.severity if worst is not None else "ok"

    @property
    def worst(self) -> FleetDiagnosis | None:
        ranked = sorted(self.diagnoses, key=lambda d: (SEVERITY_RANK.get(d.severity, 5), d.rule))
        return ranked[0] if ranked else None

    @property
    def rank(self) -> int:
        """0 is worst: its supervisor down, then the engine down, critical, warning, info, healthy."""
        if not self.supervisor.up:
            return 0
        if not self.up:
            return 1
        worst = self.worst
        return SEVERITY_RANK.get(worst.severity, 5) if worst is not None else 5


@dataclass(slots=True)
class Fleet:
    prometheus: str
    selector: str
    supervisors: list[Supervisor]
    engines: list[FleetEngine]  # worst first
    read_at: float

    @property
    def supervisors_down(self) -> list[Supervisor]:
        return [s for s in self.supervisors if not s.up]


def _inside(selector: str, *extra: str) -> str:
    matchers = ", ".join(m for m in (selector, *extra) if m)
    return "{" + matchers + "}" if matchers else ""


def _target(sample: Sample) -> Target:
    return sample.labels.get("job", ""), sample.labels.get("instance", "")


def _key(sample: Sample) -> EngineKey:
    return (*_target(sample), sample.labels.get("engine", ""))


def supervisor_url(info: Sample | None, up: Sample) -> str:
    """The supervisor's own word (`supervisor_url`, its external_url), else a `supervisor_url` the scrape config
    set, else the address Prometheus scrapes. A supervisor listening on every interface says 0.0.0.0: the
    scraped host is the one to reach it at."""
    url = (info.labels.get("supervisor_url") if info else None) or up.labels.get("supervisor_url") \
        or f"http://{up.labels.get('instance', '')}"
    parts = urlsplit(url)
    if parts.hostname in ("0.0.0.0", "::", "") and ":" in up.labels.get("instance", ""):
        host = up.labels["instance"].rsplit(":", 1)[0]
        url = parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host).geturl()
    return url.rstrip("/")


def read_supervisors(api: PrometheusApi, selector: str) -> list[Supervisor]:
    """Every target that is a kvops supervisor: it exported kvops_supervisor_info in the last hour, or it is
    scraped under the documented job name (so one that never answered is listed too)."""
    sel = _inside(selector)
    info = {_target(s): s for s in api.query(f"last_over_time(kvops_supervisor_info{sel}[{LOOKBACK}])")}
    supervisors = []
    for up in api.query(f"up{sel}"):
        target = _target(up)
        if target not in info and target[0] != SUPERVISOR_JOB:
            continue
        found = info.get(target)
        supervisors.append(Supervisor(job=target[0], instance=target[1], up=up.value == 1,
                                      url=supervisor_url(found, up),
                                      version=found.labels.get("version", "") if found else ""))
    return sorted(supervisors, key=lambda s: (s.up, s.job, s.instance))


def read_fleet(api: PrometheusApi, selector: str = "") -> Fleet:
    """The fleet now: every supervisor, and every engine of theirs with its numbers and diagnoses."""
    supervisors = {(s.job, s.instance): s for s in read_supervisors(api, selector)}
    sel = _inside(selector)
    engines: dict[EngineKey, FleetEngine] = {}
    for sample in api.query(f"last_over_time(kvops_engine_up{sel}[{LOOKBACK}])"):
        supervisor = supervisors.get(_target(sample))
        if supervisor is None:
            continue
        engines[_key(sample)] = FleetEngine(engine=sample.labels.get("engine", ""), kind=sample.labels.get("kind", ""),
                                            supervisor=supervisor, up=None)
    for sample in api.query(f"kvops_engine_up{sel}"):
        if _key(sample) in engines and engines[_key(sample)].supervisor.up:
            engines[_key(sample)].up = sample.value == 1
    live = [key for key, engine in engines.items() if engine.supervisor.up]
    for key in live:  # an engine gone from its supervisor's answers (taken out of its config) is not listed
        if engines[key].up is None:
            del engines[key]
    _numbers(api, selector, engines)
    for sample in api.query(f"kvops_diagnosis_active{sel} > 0"):
        engine = engines.get(_key(sample))
        if engine is not None and engine.supervisor.up:
            engine.diagnoses.append(FleetDiagnosis(rule=sample.labels.get("id", "?"),
                                                   severity=sample.labels.get("severity", "?"),
                                                   subjects=int(sample.value)))
    ordered = sorted(engines.values(), key=lambda e: (e.rank, -(e.kv_usage or 0.0), -(e.waiting or 0.0),
                                                      e.supervisor.instance, e.engine))
    return Fleet(prometheus=api.url, selector=selector, supervisors=list(supervisors.values()), engines=ordered,
                 read_at=time.time())


def _numbers(api: PrometheusApi, selector: str, engines: dict[EngineKey, FleetEngine]) -> None:
    """KV usage, hit rate, queue and throughput of each engine whose supervisor answers."""
    sel = _inside(selector)
    by = "sum by (job, instance, engine)"
    queries = {
        "kv_usage": f"kvops_engine_kv_cache_usage_ratio{sel}",
        "hit_rate": f"{by} (rate(kvops_engine_prefix_cache_hit_tokens_total{sel}[{RATE_WINDOW}])) / "
                    f"{by} (rate(kvops_engine_prefix_cache_query_tokens_total{sel}[{RATE_WINDOW}]))",
        "waiting": f"kvops_engine_requests_waiting{sel}",
        "running": f"kvops_engine_requests_running{sel}",
        "tokens_per_s": f"{by} (rate(kvops_engine_generation_tokens_total{sel}[{RATE_WINDOW}]))",
    }
    for attribute, expr in queries.items():
        for sample in api.query(expr):
            engine = engines.get(_key(sample))
            if engine is not None and engine.supervisor.up:
                setattr(engine, attribute, sample.value)
