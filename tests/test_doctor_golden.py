"""`kvops doctor --metrics-file` on every captured and published scrape, byte for byte as it was.

tests/fixtures/doctor-golden holds doctor's output on each scrape of tests/fixtures, taken from the code
before a change meant to keep it (33 scrapes before each kind's wording moved into its profile, the other 9
before the packages moved into their import-name folders): for the scrape F (its path with '/'
written '_'), `F.out` is `kvops doctor --metrics-file F`'s stdout and stderr then a line `rc=N`, `F.v.out`
the same with -v (no rc line: the exit code is .out's), and `F.json` with --json (its exit_code). Any
change to a line, a remedy or an exit code fails here.

Two things in the output are not the scrape's:
- doctor reads the file's mtime as the snapshot's time, and a scrape's "since start" windows and rates
  are measured from the process start to it, so the same file in a fresh clone reads differently. Each
  scrape is copied under tmp_path with the mtime the goldens were taken at (BASELINE_MTIME_NS), and read
  there by the same relative path, which the report's target names.
- the run's own duration (the text's last line, the JSON's duration_s), which is wall time.
A scrape added later needs its golden taken before the next such change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from kvops.doctor.run import main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "fixtures" / "doctor-golden"
# The fixtures' mtime when the goldens were taken (a checkout on 2026-12-02, 16:21:29 UTC); an mtime a month
# later changes four scrapes' "in the last N s" and windows.
BASELINE_MTIME_NS = 1796228489663231083
DURATION_LINE = re.compile(r"^  \(\d+\.\d s\)$", re.M)
DURATION_KEY = re.compile(r'\n  "duration_s": [^\n]*\n')


def _scrapes() -> list[str]:
    """The scrapes with goldens, as relative paths; a golden whose scrape is gone is an error, not a skip."""
    found = []
    for golden in sorted(GOLDEN.glob("*.txt.out")):
        if golden.name.endswith(".v.out"):
            continue
        stem = golden.name.removesuffix(".out")
        matches = [p for p in (ROOT / "tests" / "fixtures").rglob("*.txt")
                   if GOLDEN not in p.parents and str(p.relative_to(ROOT)).replace("/", "_") == stem]
        assert len(matches) == 1, (golden.name, matches)
        found.append(str(matches[0].relative_to(ROOT)))
    return found


SCRAPES = _scrapes()


def test_every_captured_and_published_scrape_has_a_golden():
    assert len(SCRAPES) == 42  # the scrapes under tests/fixtures when the goldens were taken


@pytest.fixture
def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of tests/fixtures under tmp_path, each scrape with the baseline's mtime; the current directory."""
    for relative in SCRAPES:
        copy = tmp_path / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / relative, copy)
        os.utime(copy, ns=(BASELINE_MTIME_NS, BASELINE_MTIME_NS))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, int]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return captured.out + captured.err, code


@pytest.mark.parametrize("scrape", SCRAPES)
def test_doctor_text_and_exit_code_are_the_goldens(scrape: str, pinned: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    stem = scrape.replace("/", "_")
    out, code = _doctor(capsys, "--metrics-file", scrape)
    assert DURATION_LINE.sub("  (0.0 s)", out) + f"rc={code}\n" == (GOLDEN / f"{stem}.out").read_text()
    out, verbose_code = _doctor(capsys, "--metrics-file", scrape, "-v")
    assert DURATION_LINE.sub("  (0.0 s)", out) == (GOLDEN / f"{stem}.v.out").read_text()
    assert verbose_code == code


@pytest.mark.parametrize("scrape", SCRAPES)
def test_doctor_json_is_the_golden(scrape: str, pinned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, code = _doctor(capsys, "--metrics-file", scrape, "--json")
    golden = (GOLDEN / f"{scrape.replace('/', '_')}.json").read_text()
    assert code == json.loads(golden)["exit_code"]
    # Compared as text, not as parsed values: key order and escaping are output too, and scripts diff it.
    assert DURATION_KEY.sub("\n", out) == DURATION_KEY.sub("\n", golden)
