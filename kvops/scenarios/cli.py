"""`kvops scenario list | run NAME... | run all`."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvops.scenarios import ENGINES, Scenario, scenarios
from kvops.scenarios.runner import ScenarioResult


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def render(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | passed | signal → diagnosis (s) | signal → verified fix (s) | metric | before | after |",
             "|---|---|---:|---:|---|---:|---:|"]
    for r in results:
        lines.append(f"| {r.name} | {'yes' if r.passed else 'NO'} | {_fmt(r.detection_s)} | "
                     f"{_fmt(r.time_to_verified_fix_s)} | {r.metric} | {_fmt(r.before, '.4g')} | "
                     f"{_fmt(r.after, '.4g')} |")
    return "\n".join(lines)


def run_one(scenario: Scenario, stack: ExitStack, sessions: dict[Any, Any]) -> ScenarioResult:
    """The scenario, in its session when it has one: opened on `stack` for the first scenario that needs it, and
    kept open for the others of the command that share it."""
    if scenario.session is None:
        return scenario.run()
    if scenario.session not in sessions:
        sessions[scenario.session] = stack.enter_context(scenario.session())
    return scenario.run(sessions[scenario.session])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvops scenario", description="Reproduce each diagnosis on the real engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    listed = commands.add_parser("list", help="the scenarios")
    run = commands.add_parser("run", help="run scenarios (names, or all)")
    run.add_argument("names", nargs="+")
    run.add_argument("--json", metavar="PATH", help="write the results as JSON")
    for command in (listed, run):
        command.add_argument("--engine", choices=ENGINES, default="kvops",
                             help="kvops's own engine, or vLLM's CPU build behind `kvops gateway` (needs `kvops vllm "
                                  "setup`) (default: %(default)s)")
    args = parser.parse_args(argv)
    found = scenarios(args.engine)
    if args.command == "list":
        for scenario in found.values():
            print(f"{scenario.name:24} {scenario.title}")
        return 0
    names = list(found) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in found]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r} on engine {args.engine}; scenarios: {', '.join(found)}")
    if args.engine == "vllm":
        from kvops.scenarios.on_vllm import vllm_missing

        missing = vllm_missing()
        if missing:
            print(f"kvops scenario: {missing}", file=sys.stderr)
            return 2
    results = []
    with ExitStack() as stack:
        sessions: dict[Any, Any] = {}
        for name in names:
            print(f"[kvops scenario] {name}: {found[name].title}", file=sys.stderr, flush=True)
            started = time.monotonic()
            try:
                result = run_one(found[name], stack, sessions)
            except Exception as exc:  # a failed scenario is a result, and the others still run
                result = ScenarioResult(name=name, title=found[name].title, error=f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
            result.duration_s = round(time.monotonic() - started, 1)
            failed = [c.name for c in result.checks if not c.passed]
            print(f"[kvops scenario] {name}: {'passed' if result.passed else 'FAILED'} in {result.duration_s} s"
                  + (f" (failed: {', '.join(failed)})" if failed else "")
                  + (f" ({result.error})" if result.error else ""), file=sys.stderr, flush=True)
            results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps([r.model_dump(mode="json") for r in results], indent=2) + "\n")
    print(render(results))
    return 0 if all(r.passed for r in results) else 1
