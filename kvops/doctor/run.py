"""`kvops doctor`: pick the target, run the sections that apply to it, render, exit 0 / 1 / 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from kvops.adapters import Scrape, ScrapeError, WatchedEngineClient, detect_flavour, snapshot_from_scrape
from kvops.doctor import configuration, environment
from kvops.doctor.cache import cache_checks, evaluate
from kvops.doctor.data_quality import data_checks
from kvops.doctor.liveness import probe
from kvops.doctor.metrics_read import attach_metrics
from kvops.doctor.render import render_json, render_text
from kvops.doctor.report import Check, Report, Status
from kvops.doctor.traffic import traffic_checks
from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.engine_client import EngineUnreachable

LOCAL_URL = "http://127.0.0.1:8000"  # `kvops engine serve`'s default address
SUPERVISOR_URL = "http://127.0.0.1:9400"  # `kvops run`'s default address: its engines are local ones too
LOCAL_CONFIG = "kvops.toml"
SAMPLES = 3
SAMPLE_INTERVAL_S = 0.5  # three snapshots over 1 s: the whole doctor stays under 2 s (issue 21)
PROFILE_REPEATS = 3  # block-size profile: enough to see a clear difference, short enough for doctor
NEEDS_TOKEN = "needs the engine's admin token: pass --admin-token or set $KVOPS_ADMIN_TOKEN"


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="a running kvops engine, or a vLLM or SGLang server (recognised from its "
                                      "/metrics and /v1/models)")
    target.add_argument("--config", metavar="FILE", help="a kvops TOML config: static checks, nothing started")
    target.add_argument("--metrics-file", metavar="FILE", help="offline: a saved /metrics scrape (kvops, vLLM "
                                                               "or SGLang)")
    parser.add_argument("--kv-quant", action="store_true",
                        help="also take the per-layer KV quantization error profile (kvops engines; pauses "
                             "serving for a few seconds)")
    parser.add_argument("--admin-token", default=os.environ.get("KVOPS_ADMIN_TOKEN"),
                        help="the kvops engine's admin token, for the profiles (default: $KVOPS_ADMIN_TOKEN)")
    parser.add_argument("--ttft-slo", type=_seconds, metavar="SECONDS",
                        help="time-to-first-token SLO: flag a p95 above it (rule latency_slo)")
    parser.add_argument("--itl-slo", type=_seconds, metavar="SECONDS",
                        help="inter-token latency SLO: flag a p95 above it (rule latency_slo)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the detail behind each line")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each answer, /health included (default: %(default)s)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 2 or 0.05)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an SLO must be more than 0 seconds")
    return value


def _slo(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The latency SLOs given on the command line, as latency_slo's settings."""
    given = {key: value for key, value in (("ttft_slo_s", getattr(args, "ttft_slo", None)),
                                           ("itl_slo_s", getattr(args, "itl_slo", None))) if value is not None}
    return {"latency_slo": given} if given else {}


def run_doctor(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        report = diagnose(args)
    except KeyboardInterrupt:
        raise
    report.duration_s = time.perf_counter() - started
    print(render_json(report) if args.json else render_text(report, verbose=args.verbose))
    return report.exit_code


def diagnose(args: argparse.Namespace) -> Report:
    if args.metrics_file:
        return _metrics_file(Path(args.metrics_file), _slo(args))
    if args.url:
        parsed = urlparse(args.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            return Report(target=args.url, could_not_check=f"{args.url!r} is not an http(s) URL: write e.g. "
                                                           "--url http://127.0.0.1:8000")
        report = Report(target=args.url.rstrip("/"))
        _engine(report, args.url.rstrip("/"), args, local=False)
        return report
    if args.config:
        report = Report(target=f"config {args.config}")
        _environment(report)
        _static(report, args.config)
        return report
    report = Report(target="this machine" + (f", {LOCAL_CONFIG}" if Path(LOCAL_CONFIG).is_file() else ""))
    _environment(report)
    _static(report, LOCAL_CONFIG if Path(LOCAL_CONFIG).is_file() else None)
    _engine(report, _local_engine(report, args.timeout), args, local=True)
    return report


def _local_engine(report: Report, timeout_s: float) -> str:
    """The engine a plain `kvops doctor` examines: the first one a local supervisor runs (a managed
    engine's port is picked at start), else `kvops engine serve`'s default address."""
    try:
        answer = httpx.get(f"{SUPERVISOR_URL}/api/engines", timeout=min(timeout_s, 2.0)).json()
        engines = [(str(e["name"]), str(e["url"])) for e in answer if isinstance(e, dict) and e.get("url")]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return LOCAL_URL
    if not engines:
        return LOCAL_URL
    (name, url), others = engines[0], engines[1:]
    report.add(Check(section="Liveness", title="Supervisor", status=Status.INFO,
                     evidence=f"kvops run at {SUPERVISOR_URL} runs {len(engines)} engine(s); checking {name} at {url}",
                     remedy="; ".join(f"kvops doctor --url {u} ({n})" for n, u in others)))
    return url


# ------------------------------------------------------------------- targets

def _environment(report: Report) -> None:
    for check in environment.python_stack():
        report.add(check)
    report.add(environment.accelerator())


def _static(report: Report, path: str | None) -> None:
    from kvops.engine.config import EngineConfig
    from kvops.engine.errors import ConfigError
    from kvops.supervisor.config import load_config

    try:
        config = load_config(path)
    except ConfigError as exc:
        report.could_not_check = str(exc)
        return
    for spec in config.engines:
        if not spec.managed:
            report.add(Check(section=configuration.SECTION, title=f"[{spec.name}]", status=Status.SKIPPED,
                             evidence=f"watched engine at {spec.url}: nothing to check statically",
                             remedy=f"kvops doctor --url {spec.url}"))
            continue
        try:
            engine_config = EngineConfig(**spec.args)
        except ConfigError as exc:
            report.add(Check(section=configuration.SECTION, title=f"[{spec.name}] engine settings",
                             status=Status.FAIL, evidence=str(exc)))
            continue
        for check in configuration.static_checks(spec.name, engine_config):
            report.add(check)


def _metrics_file(path: Path, slo: dict[str, dict[str, float]]) -> Report:
    report = Report(target=f"scrape {path}")
    try:
        text = path.read_text()
    except OSError as exc:
        report.could_not_check = f"cannot read {path}: {exc.strerror or exc}"
        return report
    try:
        scrape = Scrape.parse(text)
    except ScrapeError as exc:
        report.could_not_check = f"{path}: {exc}"
        return report
    flavour = detect_flavour(scrape)
    if flavour is None:
        report.could_not_check = (f"{path} has no kvops_, vllm: or sglang: metrics: save the engine's /metrics "
                                  "(curl http://HOST:PORT/metrics > scrape.txt)")
        return report
    report.flavour = flavour
    snap = snapshot_from_scrape(flavour, scrape, path.stat().st_mtime)
    if "uptime_s" in snap.unknown:  # a scrape without the process start: doctor then reads it as an hour's work
        report.add(Check(section="Liveness", title="Process start", status=Status.INFO,
                         evidence="the scrape has no process_start_time_seconds: rates are taken over an assumed "
                                  "hour"))
    if scrape.damaged_lines:
        report.add(Check(section="Liveness", title="Scrape", status=Status.WARN,
                         evidence=f"{len(scrape.damaged_lines)} line(s) do not parse (a cut-off scrape?); "
                                  "the checks use the rest",
                         detail=scrape.damaged_lines[:5]))
    report.add(Check(section="Liveness", title="Liveness", status=Status.SKIPPED,
                     evidence="an offline scrape: nothing to ask", remedy="kvops doctor --url URL for a live check"))
    _snapshot_sections(report, [snap], None, "", None,
                       "an offline scrape cannot measure block sizes", slo)
    return report


def _engine(report: Report, url: str, args: argparse.Namespace, local: bool) -> None:
    found = probe(url, args.timeout)
    if local and not found.answering and found.checks and found.checks[0].title == "Listening":
        report.add(Check(section="Liveness", title="Local engine", status=Status.INFO,
                         evidence=f"none running at {url}; the checks above are the configuration's",
                         remedy="start one: kvops engine serve; or check another: kvops doctor --url URL"))
        return
    for check in found.checks:
        report.add(check)
    if found.flavour is None:
        return
    report.flavour = found.flavour
    try:
        snaps = _sample(url, found.flavour, args.timeout)
    except EngineUnreachable as exc:
        report.add(Check(section="Liveness", title="Snapshot", status=Status.FAIL, evidence=str(exc)))
        return
    kv_profile, kv_why = None, ""
    block_profile, block_why = None, ""
    if found.flavour == "kvops":
        block_profile, block_why = _profile(url, "block-size", BlockSizeProfile, args.admin_token,
                                            {"repeats": PROFILE_REPEATS}, args.timeout)
        if args.kv_quant:
            kv_profile, kv_why = _profile(url, "kv-quant", KVQuantProfile, args.admin_token, {}, args.timeout)
    else:
        block_why = kv_why = f"a {found.flavour} server has no kvops profile endpoints"
    if not local:
        report.add(environment.engine_device(snaps[-1]))
    _snapshot_sections(report, snaps, kv_profile, kv_why, block_profile, block_why, _slo(args))


def _snapshot_sections(report: Report, snaps: list[Snapshot], kv_profile: KVQuantProfile | None, kv_why: str,
                       block_profile: BlockSizeProfile | None, block_why: str,
                       slo: dict[str, dict[str, float]] | None = None) -> None:
    latest = snaps[-1]
    checks = [*data_checks(snaps), *configuration.snapshot_checks(latest)]
    if latest.source == "kvops" or block_profile is not None:
        checks.append(configuration.block_size_check(latest, block_profile, block_why))
    diagnoses, _ = evaluate(snaps, kv_profile, slo)
    checks += cache_checks(snaps, kv_profile, kv_why, diagnoses)
    checks += traffic_checks(snaps, diagnoses)
    attach_metrics(checks, latest)
    for check in checks:
        report.add(check)


def _sample(url: str, flavour: str, timeout_s: float) -> list[Snapshot]:
    """SAMPLES snapshots SAMPLE_INTERVAL_S apart: enough for a trend over the sample, not for the
    supervisor's windows (see kvops.doctor.cache for how the rules read them)."""
    client = WatchedEngineClient(url, flavour, timeout_s=timeout_s)
    try:
        snaps = []
        for index in range(SAMPLES):
            if index:
                time.sleep(SAMPLE_INTERVAL_S)
            snaps.append(client.snapshot())
        return snaps
    finally:
        client.close()


def _profile(url: str, which: str, model: Any, token: str | None, params: dict[str, Any],
             timeout_s: float) -> tuple[Any, str]:
    """An on-demand profile through the admin API; (None, why) when it cannot be had."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(f"{url}/admin/profile/{which}", params=params, headers=headers,
                             timeout=max(timeout_s, 120.0))
    except httpx.HTTPError as exc:
        return None, f"GET /admin/profile/{which}: {type(exc).__name__}: {exc}"
    if response.status_code == 401:
        return None, f"{NEEDS_TOKEN} (the engine answered 401)"
    if response.status_code == 403:
        return None, "the engine refused the admin token (403): check --admin-token / $KVOPS_ADMIN_TOKEN"
    if response.status_code == 404:
        return None, "the engine's admin endpoints are off: restart it with --admin-token to allow profiles"
    if response.status_code != 200:
        return None, f"GET /admin/profile/{which} → {response.status_code}: {response.text[:160]}"
    try:
        return model.model_validate_json(response.content), ""
    except ValueError as exc:
        return None, f"GET /admin/profile/{which}: unexpected answer: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvops doctor")
    add_doctor_args(parser)
    return run_doctor(parser.parse_args(argv if argv is not None else sys.argv[1:]))
