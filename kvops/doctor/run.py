"""`kvops doctor`: pick the target, run the sections that apply to it, render, exit 0 / 1 / 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from kvops.adapters import Scrape, ScrapeError
from kvops.doctor.events import DEFAULT_WINDOW_S
from kvops.doctor.liveness import known_prefixes
from kvops.doctor.render import render_json, render_text
from kvops.doctor.report import Report
from kvops.doctor.sections import SECTIONS
from kvops.doctor.validator import Examined, run_sections
from kvops.kinds import detect, kinds, profile, snapshot_from_scrape

if TYPE_CHECKING:
    from kvops.doctor.listening import Listening

LOCAL_CONFIG = "kvops.toml"


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help=f"a running {_titles()} server (recognised from its /metrics and /v1/models)")
    target.add_argument("--config", metavar="FILE", help="a kvops TOML config: static checks, nothing started")
    target.add_argument("--metrics-file", metavar="FILE", help=f"offline: a saved /metrics scrape ({_titles()})")
    target.add_argument("--prometheus", metavar="URL", help="the fleet: every engine of every kvops supervisor this "
                        "Prometheus scrapes, worst first, with each troubled engine's diagnoses from its supervisor")
    parser.add_argument("--selector", metavar="'{LABEL=\"VALUE\",...}'",
                        help="with --prometheus: only the supervisors whose series match, e.g. '{cluster=\"a\"}'")
    parser.add_argument("--kv-quant", action="store_true",
                        help="also take the per-layer KV quantization error profile (kvops engines; pauses "
                             "serving for a few seconds)")
    parser.add_argument("--admin-token", default=os.environ.get("KVOPS_ADMIN_TOKEN"),
                        help="the kvops engine's admin token, for the profiles (default: $KVOPS_ADMIN_TOKEN)")
    parser.add_argument("--ttft-slo", type=_seconds, metavar="SECONDS",
                        help="time-to-first-token SLO: flag a p95 above it (rule latency_slo)")
    parser.add_argument("--itl-slo", type=_seconds, metavar="SECONDS",
                        help="inter-token latency SLO: flag a p95 above it (rule latency_slo)")
    events = parser.add_argument_group("KV cache events (with --url: a vLLM started with --kv-events-config)")
    events.add_argument("--events", metavar="ENDPOINT",
                        help="its publisher's endpoint, exactly as in its --kv-events-config (tcp://*:5557, "
                             "tcp://HOST:PORT or ipc:///PATH): doctor listens, and reports the stream and the blocks")
    events.add_argument("--events-replay", metavar="ENDPOINT", help="its replay_endpoint: with the first batch that "
                        "arrives, what was resident before doctor joined is read, and missed batches are asked again")
    events.add_argument("--events-topic", metavar="TOPIC", default="", help="its topic (default: vLLM's, \"\")")
    events.add_argument("--events-window", metavar="SECONDS", type=_seconds, default=DEFAULT_WINDOW_S,
                        help="how long to listen (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the detail behind each line")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each answer, /health included (default: %(default)s)")


def _titles() -> str:
    """The kinds doctor reads, as people write them: "kvops, vLLM or SGLang"."""
    titles = [profile(kind).title for kind in kinds()]
    return f"{', '.join(titles[:-1])} or {titles[-1]}" if len(titles) > 1 else "".join(titles)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 2 or 0.05)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
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
    """Pick the target, read what can be read up front (a scrape, a config), then run every section."""
    examined = Examined(timeout_s=args.timeout, admin_token=args.admin_token, kv_quant=args.kv_quant,
                        slo=_slo(args))
    if getattr(args, "events", None) is not None and not args.url:
        return Report(target="KV cache events", could_not_check="--events listens to the KV events of the engine "
                                                                 "given by --url: add --url http://HOST:PORT")
    if getattr(args, "selector", None) and not getattr(args, "prometheus", None):
        return Report(target="the fleet", could_not_check="--selector picks engines of a fleet: add --prometheus URL")
    if getattr(args, "prometheus", None):
        from kvops.doctor.fleet import fleet_report

        return fleet_report(args.prometheus, args.selector, args.timeout)
    if args.metrics_file:
        report = _metrics_file(examined, Path(args.metrics_file))
    elif args.url:
        parsed = urlparse(args.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            return Report(target=args.url, could_not_check=f"{args.url!r} is not an http(s) URL: write e.g. "
                                                           "--url http://127.0.0.1:8000")
        examined.url = args.url.rstrip("/")
        report = Report(target=examined.url)
    elif args.config:
        report = Report(target=f"config {args.config}")
        examined.machine = True
        _load_config(report, examined, args.config)
    else:
        report = Report(target="this machine" + (f", {LOCAL_CONFIG}" if Path(LOCAL_CONFIG).is_file() else ""))
        examined.machine = examined.local = True
        _load_config(report, examined, LOCAL_CONFIG if Path(LOCAL_CONFIG).is_file() else None)
    if report.could_not_check and args.metrics_file:
        return report
    examined.events = _listen(args, examined)
    try:
        run_sections(report, examined, SECTIONS)
    finally:
        if examined.events is not None:
            examined.events.close()
    report.kind = examined.kind
    return report


def _listen(args: argparse.Namespace, examined: Examined) -> Listening | None:
    """Subscribe to the engine's KV events before the sections run, so that the window overlaps their work."""
    endpoint = getattr(args, "events", None)
    if endpoint is None or examined.url is None:
        return None
    from kvops.doctor.listening import listen

    return listen(endpoint, args.events_replay, args.events_topic, args.events_window,
                  urlparse(examined.url).hostname or "127.0.0.1")


def _load_config(report: Report, examined: Examined, path: str | None) -> None:
    """The config to check statically; one that does not load is why doctor could not check (exit 2), while
    the machine (and a local engine) are still checked."""
    from kvops.schema.errors import ConfigError
    from kvops.supervisor.config import load_config

    try:
        examined.config = load_config(path)
    except ConfigError as exc:
        report.could_not_check = str(exc)


def _metrics_file(examined: Examined, path: Path) -> Report:
    """A saved scrape read into one snapshot, its file's mtime the snapshot's time."""
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
    found = detect(scrape)
    if found is None:
        report.could_not_check = (f"{path} has no {known_prefixes()} metrics: save the engine's /metrics "
                                  "(curl http://HOST:PORT/metrics > scrape.txt)")
        return report
    examined.metrics_file, examined.scrape, examined.kind = path, scrape, found.kind
    examined.block_why = "an offline scrape cannot measure block sizes"
    examined.snaps = [snapshot_from_scrape(found.kind, scrape, path.stat().st_mtime)]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvops doctor")
    add_doctor_args(parser)
    return run_doctor(parser.parse_args(argv if argv is not None else sys.argv[1:]))
