"""Doctor's sections behind one interface: a section that raises leaves a "could not check" line under its
heading, and the rest of the report as it would have been (flutter doctor's crash isolation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvops.doctor import sections
from kvops.doctor.report import FLEET
from kvops.doctor.report import SECTIONS as HEADINGS
from kvops.doctor.run import main
from kvops.doctor.sections import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
CLEAN = ROOT / "tests" / "fixtures" / "metrics" / "kvops.txt"  # a kvops scrape doctor finds nothing wrong in
FLOODED = ROOT / "tests" / "fixtures" / "vllm-cpu" / "pressure.txt"  # problems in several sections


def _planted(*args: object, **kwargs: object) -> list[object]:
    raise ZeroDivisionError("planted")


def _lines(text: str) -> dict[str, list[str]]:
    """The text report's lines by section heading; the footer (issue count, duration) apart, under ""."""
    found: dict[str, list[str]] = {}
    heading = ""
    for line in text.splitlines():
        if line in HEADINGS:
            heading = line
        elif line.startswith("  ") and not line.startswith("  ("):
            found.setdefault(heading, []).append(line)
        elif line.strip() and not line.startswith("  ("):
            found.setdefault("", []).append(line)
    return found


def _doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, int]:
    code = main(list(argv))
    return capsys.readouterr().out, code


def test_every_section_has_a_heading_the_report_shows():
    # the fleet's heading is the --prometheus report's (kvops.doctor.fleet), which no validator of one target fills
    assert {section.name for section in SECTIONS} == set(HEADINGS) - {FLEET}


@pytest.mark.parametrize("scrape", [CLEAN, FLOODED])
def test_a_section_that_raises_is_one_line_and_the_rest_is_unchanged(scrape, monkeypatch, capsys):
    before, before_code = _doctor(capsys, "--metrics-file", str(scrape), "-v")
    monkeypatch.setattr(sections, "cache_checks", _planted)
    after, code = _doctor(capsys, "--metrics-file", str(scrape), "-v")

    assert "Traceback" not in after
    was, now = _lines(before), _lines(after)
    for heading in was:
        if heading not in ("Cache health", ""):
            assert now[heading] == was[heading], heading
    crashed = now["Cache health"]
    assert crashed[0].startswith("  [!] Cache health: could not check: ZeroDivisionError: planted (in "), crashed
    assert "_planted" in crashed[0]  # where it raised
    assert any("• raised in" in line and "sections.py" in line for line in crashed)  # -v: the frames
    # A check that did not run is not a clean bill: an issue, counted like the others.
    assert code == 1 and now[""][-1].startswith("! Doctor found") and (before_code == 0 or scrape == FLOODED)


def test_the_rules_raising_cost_both_sections_that_read_them_and_nothing_else(monkeypatch, capsys):
    monkeypatch.setattr("kvops.doctor.cache.evaluate", _planted)
    out, code = _doctor(capsys, "--metrics-file", str(FLOODED), "--json")
    report = json.loads(out)
    crashed = [c for c in report["checks"] if c["evidence"].startswith("could not check:")]
    assert [c["section"] for c in crashed] == ["Cache health", "Traffic"]
    assert all(c["status"] == "warn" and "ZeroDivisionError: planted" in c["evidence"] for c in crashed)
    assert {c["section"] for c in report["checks"]} == {"Liveness", "Metrics data", "Configuration", "Cache health",
                                                       "Traffic"}
    assert code == report["exit_code"] == 1 and not report["could_not_check"]


# ------------------------------------------------------------------ per-kind wording comes from the profiles

def test_no_doctor_module_names_an_engine_kind_in_a_string():
    import ast

    from kvops.kinds import kinds

    named = [f"{path.name}:{node.lineno} {node.value!r}" for path in sorted((ROOT / "kvops" / "doctor").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in kinds()]
    assert not named  # ask kvops.kinds.profile(kind) instead


def test_doctor_words_a_kind_as_its_profile_does(monkeypatch, capsys):
    from dataclasses import replace

    import kvops.kinds
    from kvops.doctor.liveness import probe
    from kvops.kinds import EngineProfile, Recognition, Remedy

    sglang = kvops.kinds.PROFILES["sglang"]
    monkeypatch.setitem(kvops.kinds.PROFILES, "sglang", replace(sglang, notes={
        **sglang.notes, "no_preemption_counter": "a throwaway reason"}))
    monkeypatch.setitem(kvops.kinds.PROFILES, "throwaway", EngineProfile(
        kind="throwaway", title="Throwaway", recognition=Recognition(("throwaway:",)), read_scrape=None,
        remedies={Remedy.START: "throwaway-serve --port {port}"}))

    scrape = ROOT / "tests" / "fixtures" / "published" / "sglang-0.4.0-queue-backlog.txt"
    out, _ = _doctor(capsys, "--metrics-file", str(scrape))
    assert "[-] Preemptions: sglang does not report preemptions (a throwaway reason)" in out
    [listening] = probe("http://127.0.0.1:9", 1.0).checks  # port 9 (discard): nothing listens
    assert "; throwaway: throwaway-serve --port 9;" in listening.remedy
