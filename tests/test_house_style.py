"""What the tree says is about the code, not the tracker: no issue or stop numbers in code or docs (they mean
nothing to a reader of the tree; the history is in git). docs/results/ holds recorded reports as they were made."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cpp", ".h", ".tcss", ""}
FOLDERS = ("kvops", "tests", "docs", "benchmarks", "scripts", "alerts", "deploy", ".ci")
# "issue 31", "Issue 32's", "issues 30 + 31", "stop 48": the project's own tracker. Another project's issue is cited
# by its repository and number (vllm-project/vllm#1234) and is not matched.
TRACKER_NUMBER = re.compile(r"\b(?:[Ii]ssues? \d+|[Ss]tops? \d+)\b")


def tracker_numbers(text: str) -> list[str]:
    return [match.group(0) for match in TRACKER_NUMBER.finditer(text)]


def _files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if (path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts
                    and ROOT / "docs" / "results" not in path.parents and "fixtures" not in path.parts):
                found.append(path)
    return found


def test_no_issue_or_stop_numbers_in_code_or_docs() -> None:
    this = Path(__file__).resolve()
    offenders = [f"{path.relative_to(ROOT)}:{number}: {found}" for path in _files() if path.resolve() != this
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 for found in tracker_numbers(line)]
    assert not offenders, "tracker numbers in the tree (say what the thing is instead):\n" + "\n".join(offenders)


def test_the_scan_finds_each_form() -> None:
    assert tracker_numbers("before issue 21: the doctor; Issue 32's targets; issues 30 + 31; stop 48") == [
        "issue 21", "Issue 32", "issues 30", "stop 48"]
    assert tracker_numbers("vllm-project/vllm#1234, pr11915, 16 streams, stop_token_ids 2") == []
