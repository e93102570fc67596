"""`kvops doctor --prometheus URL [--selector '{...}']`: the fleet Prometheus scrapes, one line per engine.

The fleet comes from Prometheus (kvops.fleet); the words behind each engine's diagnoses (what is wrong, with the
numbers, and the fix) from its supervisor's own API, at the `supervisor_url` it exports: that is the drill-down.
A supervisor that does not answer costs only its engines' words, not the report.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvops.doctor.report import FLEET, Check, Report, Status
from kvops.fleet.prometheus_api import PrometheusApi, PrometheusError, parse_selector
from kvops.fleet.render import cells, summary, worst_text
from kvops.fleet.view import SEVERITY_RANK, Fleet, FleetEngine, Supervisor, read_fleet

SECTION = FLEET
STATUS = {"supervisor down": Status.FAIL, "engine down": Status.FAIL, "critical": Status.FAIL,
          "warning": Status.WARN, "info": Status.INFO, "ok": Status.OK}


def fleet_report(prometheus: str, selector: str | None, timeout_s: float) -> Report:
    report = Report(target=f"the fleet at {prometheus}" + (f" {selector}" if selector else ""))
    try:
        matchers = parse_selector(selector)
        with PrometheusApi(prometheus, timeout_s=timeout_s) as api:
            fleet = read_fleet(api, matchers)
    except PrometheusError as exc:
        report.could_not_check = str(exc)
        return report
    if not fleet.supervisors:
        report.could_not_check = (f"Prometheus at {fleet.prometheus} scrapes no kvops supervisor"
                                  + (f" matching {{{matchers}}}" if matchers else "")
                                  + ": no target exported kvops_supervisor_info in the last hour, and none is in the "
                                    "job kvops-supervisor; add the scrape config of docs/deployment.md")
        return report
    report.add(Check(section=SECTION, title="Prometheus", status=Status.OK, evidence=summary(fleet),
                     metrics=["up", "kvops_supervisor_info", "kvops_engine_up", "kvops_diagnosis_active"]))
    for supervisor in fleet.supervisors_down:
        report.add(_down(supervisor, fleet))
    details = _details(fleet, timeout_s)
    for engine in fleet.engines:
        report.add(_engine_check(engine, details.get((engine.supervisor.url, engine.engine))))
    return report


def _down(supervisor: Supervisor, fleet: Fleet) -> Check:
    engines = [e.engine for e in fleet.engines if e.supervisor is supervisor]
    watched = f"; it watched {', '.join(engines)}" if engines else "; no engine of it seen in the last hour"
    return Check(section=SECTION, title=f"supervisor {supervisor.url}", status=Status.FAIL,
                 evidence=f"Prometheus cannot scrape it (up == 0, job {supervisor.job}, instance "
                          f"{supervisor.instance}){watched}: nobody diagnoses or fixes those engines now",
                 remedy="start its `kvops run` again (in Kubernetes: kubectl logs POD -c kvops says why it stopped)")


def _details(fleet: Fleet, timeout_s: float) -> dict[tuple[str, str], list[dict[str, Any]] | str]:
    """Each troubled engine's diagnoses as its supervisor states them, or why they could not be read."""
    found: dict[tuple[str, str], list[dict[str, Any]] | str] = {}
    urls = {e.supervisor.url for e in fleet.engines if e.diagnoses and e.supervisor.up}
    for url in sorted(urls):
        try:
            answer = httpx.get(f"{url}/api/diagnoses", timeout=timeout_s)
            answer.raise_for_status()
            diagnoses = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            for engine in fleet.engines:
                if engine.supervisor.url == url:
                    found[(url, engine.engine)] = f"its supervisor's API at {url} did not answer ({exc})"
            continue
        for diagnosis in diagnoses if isinstance(diagnoses, list) else []:
            entry = found.setdefault((url, str(diagnosis.get("engine"))), [])
            if isinstance(entry, list):
                entry.append(diagnosis)
    return found


def _engine_check(engine: FleetEngine, detail: list[dict[str, Any]] | str | None) -> Check:
    row = dict(zip(("engine", "kind", "status", "worst", "kv", "hit", "waiting", "running", "tokens", "url"),
                   cells(engine), strict=True))
    numbers = (f"KV {row['kv']}, prefix hits {row['hit']}, {row['waiting']} waiting, {row['running']} running, "
               f"{row['tokens']} tok/s")
    check = Check(section=SECTION, title=f"{engine.engine} ({engine.kind}) at {engine.supervisor.url}",
                  status=STATUS.get(engine.status, Status.WARN), evidence=numbers)
    if engine.status == "supervisor down":
        check.evidence = "its supervisor is not answering: its state now is unknown"
        check.remedy = "start its supervisor again"
        return check
    if engine.status == "engine down":
        check.evidence = f"its supervisor sees it down; {numbers}"
        check.remedy = f"kvops top --attach {engine.supervisor.url} shows why (the engine's last error and log)"
        return check
    if not engine.diagnoses:
        return check
    check.evidence = f"{worst_text(engine)}; {numbers}"
    check.rule = engine.worst.rule if engine.worst else None
    if isinstance(detail, str):
        check.detail.append(detail)
    stated = sorted(detail if isinstance(detail, list) else [],
                    key=lambda d: (SEVERITY_RANK.get(str(d.get("severity")), 5), str(d.get("rule"))))
    for diagnosis in stated:
        check.detail.append(f"{diagnosis.get('rule')} ({diagnosis.get('severity')}): {diagnosis.get('summary')}")
    # the remedy of the worst diagnosis that has one: the line's mark is the worst's
    fixes = [d["fix"]["description"] for d in stated if isinstance(d.get("fix"), dict)]
    check.remedy = fixes[0] if fixes else f"kvops top --attach {engine.supervisor.url} shows the diagnosis"
    return check
