"""What `kvops bench` measured: the runs and results of each system, the table, and where they go."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvops.bench.workloads import Workload

SYSTEMS = ("hf-generate", "hf-padded", "hf-cb", "kvops")
PEERS = ("hf-generate", "hf-padded", "hf-cb")
SINGLE_SYSTEMS = ("hf-generate", "kvops")  # the single-request case compares these two only
SYSTEM_LABELS = {
    "hf-generate": "transformers generate, one prompt at a time",
    "hf-padded": "transformers generate, one left-padded batch",
    "hf-cb": "transformers continuous batching (generate_batch, paged)",
    "kvops": "kvops engine",
}


def log(message: str) -> None:
    print(f"[kvops bench] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """One timed run of one system on one workload."""

    wall_s: float
    generated_tokens: int  # useful tokens: each request's own requested tokens, as actually generated
    computed_tokens: int  # every token the system generated, including padding rows' surplus
    outputs: list[list[int]] = field(repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class SystemResult:
    """Every run of one system on one workload; the median run is the one reported."""

    system: str
    runs: list[Run]
    agreement: tuple[int, int] | None = None  # requests whose tokens equal the reference system's, of all
    reference: str | None = None

    @property
    def median(self) -> Run:
        ordered = sorted(self.runs, key=lambda r: r.wall_s)
        return ordered[(len(ordered) - 1) // 2]

    def to_json(self) -> dict[str, Any]:
        best = self.median
        out: dict[str, Any] = {
            "system": self.system,
            "label": SYSTEM_LABELS[self.system],
            "generated_tokens": best.generated_tokens,
            "computed_tokens": best.computed_tokens,
            "wall_s": round(best.wall_s, 4),
            "cpu_s": best.extra.get("cpu_s"),
            "details": best.extra,  # of the median run
            "tok_s": round(best.tok_s, 3),
            "runs": [{"wall_s": round(r.wall_s, 4), "tok_s": round(r.tok_s, 3),
                      "generated_tokens": r.generated_tokens, **r.extra} for r in self.runs],
        }
        if self.agreement is not None:
            out["same_tokens_as_reference"] = {"reference": self.reference, "requests": self.agreement[0],
                                               "of": self.agreement[1]}
        return out


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def mark_agreement(results: dict[str, SystemResult], w: Workload) -> None:
    """Mark each result with how many requests generated the reference system's tokens."""
    reference = "hf-generate" if "hf-generate" in results else ("kvops" if "kvops" in results else None)
    if reference is None:
        return
    want = results[reference].runs[0].outputs
    for result in results.values():
        got = result.runs[0].outputs
        same = sum(1 for a, b, n in zip(got, want, w.max_tokens, strict=True) if a[:n] == b[:n])
        result.agreement, result.reference = (same, w.num_requests), reference


def render_table(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"## kvops bench: {report['model']}, fp32, greedy, CPU, {env['torch_threads']} torch threads",
        "",
        "| workload | system | requests | prompt tok | generated tok | wall s | cpu s | tok/s | kvops × "
        "| same tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    waste_rows = []
    for name, wl in report["workloads"].items():
        for system, res in wl["systems"].items():
            ratio = wl["ratios"].get(system)
            same = res.get("same_tokens_as_reference")
            same_s = "ref" if same and same["reference"] == system else (
                f"{same['requests']}/{same['of']}" if same else "-")
            gen = f"{res['generated_tokens']}"
            if res["computed_tokens"] != res["generated_tokens"]:
                gen += f" ({res['computed_tokens']} computed)"
            lines.append(f"| {name} | {system} | {wl['requests']} | {wl['prompt_tokens']} | {gen} | "
                         f"{res['wall_s']:.1f} | {_fmt(res['cpu_s'])} | {res['tok_s']:.1f} | "
                         f"{_fmt(ratio, '.2f', '×')} | {same_s} |")
        for system, error in wl["failed"].items():
            lines.append(f"| {name} | {system} | {wl['requests']} | {wl['prompt_tokens']} | failed: "
                         f"{error[:120].replace('|', '/')} | - | - | - | - | - |")
        kv = wl["systems"].get("kvops")
        if kv:
            run = kv["details"]
            waste_rows.append(
                f"| {name} | {_fmt(run['kv_waste_steady'] and 100 * run['kv_waste_steady'], '.1f', '%')} | "
                f"{run['steady_steps']}/{run['steps']} (≥{run['steady_threshold_running']} running) | "
                f"{_fmt(run['kv_waste_all_steps'] and 100 * run['kv_waste_all_steps'], '.1f', '%')} | "
                f"{run['max_running']} | {run['preemptions']} | {run['prefix_hit_tokens']} |")
    if waste_rows:
        lines += [
            "",
            f"kvops KV waste (block_size {report['config']['block_size']}; 1 - used/allocated slots, "
            "sampled after every step):",
            "",
            "| workload | steady-state waste | steady steps | all-steps waste | max running | preemptions "
            "| prefix-hit tokens |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *waste_rows,
        ]
    load = env["loadavg_start"], env["loadavg_end"]
    lines += [
        "",
        "Notes: tok/s = useful generated tokens / wall time of the generation call(s) (model load and "
        "a small warm-up excluded); cpu s = process CPU time over the same span (all threads); median of "
        f"{report['config']['repeat']} run(s). kvops × = kvops tok/s / that system's tok/s. EOS never ends a "
        "request, so every system generates exactly the requested tokens. hf-padded on a workload with "
        "different output lengths runs the whole batch to the longest output: only each request's own "
        "requested tokens count as useful (the computed total is in brackets). \"same tokens\" = requests "
        "whose tokens equal the reference system's (ref). hf-cb is sized like the engine (same KV bytes, "
        "batch-token budget and request cap; page size 256).",
        f"Load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f} on {env['cpu_count']} CPUs"
        + (" — other processes were competing for the CPUs; absolute numbers are low and noisy."
           if max(load) > env["cpu_count"] + 0.5 else "."),
    ]
    return "\n".join(lines)


def configure_logging() -> None:
    """Warnings only, on stderr: the engine's info logs would interleave with the benchmark's progress lines."""
    import structlog

    if structlog.is_configured():
        return
    try:
        from kvops.logs import configure_logging as configure_kvops_logging
    except ImportError:
        import logging

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    else:
        configure_kvops_logging("warning", json_logs=False)


def publish(report: dict[str, Any], table: str, json_path: str | None) -> None:
    """Print the table; with --json also write the report (table included) to `json_path`."""
    report["table"] = table
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        log(f"results written to {path}")
    print(table, flush=True)


