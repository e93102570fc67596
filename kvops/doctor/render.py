"""The flutter-doctor style text: a line per check, grouped by section, remedies under the problems."""

from __future__ import annotations

import json

from kvops.doctor.report import SECTIONS, Report, Status

MARKS = {Status.OK: "[✓]", Status.INFO: "[i]", Status.WARN: "[!]", Status.FAIL: "[✗]", Status.SKIPPED: "[-]"}


def render_text(report: Report, verbose: bool = False) -> str:
    lines = [f"kvops doctor: {report.target}" + (f" ({report.kind})" if report.kind else "")]
    if not verbose:
        lines[0] += " — run with -v for the detail behind each line"
    for section in SECTIONS:
        checks = [c for c in report.checks if c.section == section]
        if not checks:
            continue
        lines.append("")
        lines.append(section)
        for check in checks:
            lines.append(f"  {MARKS[check.status]} {check.title}: {check.evidence}")
            if check.remedy and check.status not in (Status.OK,):
                lines.append(f"      → {check.remedy}")
            if verbose:
                lines.extend(f"      • {line}" for line in check.detail)
                if check.metrics:
                    lines.append(f"      • read: {', '.join(check.metrics)}")
    lines.append("")
    if report.could_not_check:
        lines.append(f"✗ Could not check: {report.could_not_check}")
    elif report.problems:
        sections = len({c.section for c in report.problems})
        lines.append(f"! Doctor found {len(report.problems)} issue(s) in {sections} section(s).")
    else:
        lines.append("• No issues found.")
    lines.append(f"  ({report.duration_s:.1f} s)")
    return "\n".join(lines)


def render_json(report: Report) -> str:
    body = report.model_dump(mode="json", by_alias=True)
    body["exit_code"] = report.exit_code
    return json.dumps(body, indent=2)
