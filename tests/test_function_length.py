"""No function in kvops/ runs over MAX_LINES lines without saying why: a long function is
where a reader gets lost, so it is split, or it carries a `# Long: <why>` comment on the line right above its
`def` (or above its first decorator) or as the first line of its body. Nested functions count on their own.

From the command line, `python tests/test_function_length.py` prints the offenders.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("kvops",)
MAX_LINES = 80
MARK = "# Long:"
MIN_REASON = 10  # characters after the mark: "# Long: yes" is not a reason


@dataclass(frozen=True)
class LongFunction:
    path: Path
    name: str
    line: int
    length: int
    reason: str  # "" when none is given

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} {self.name}: {self.length} lines"


def _reason(text: str) -> str:
    stripped = text.strip()
    if not stripped.startswith(MARK):
        return ""
    why = stripped[len(MARK):].strip()
    return why if len(why) >= MIN_REASON else ""


def _stated_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The `# Long:` reason above the def (or its first decorator), or opening the body, if any."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    above = [lines[first - 2]] if first >= 2 else []
    # Between the `def` line and the first statement: the rest of the signature, then any leading comments.
    opening = [line for line in lines[node.lineno:node.body[0].lineno - 1] if line.strip().startswith("#")]
    for text in above + opening[:1]:
        if _reason(text):
            return _reason(text)
    return ""


def long_functions(path: Path) -> list[LongFunction]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > MAX_LINES:
            found.append(LongFunction(path, node.name, node.lineno, length, _stated_reason(lines, node)))
    return sorted(found, key=lambda f: f.line)


def scanned_files() -> list[Path]:
    """Every module once: kvops/engine and kvops/kernels may be links to engine/ and kernels/."""
    seen: dict[Path, Path] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            seen.setdefault(path.resolve(), path)
    return sorted(seen.values())


def offenders() -> list[LongFunction]:
    return [f for path in scanned_files() for f in long_functions(path) if not f.reason]


def test_no_long_function_without_a_reason() -> None:
    found = offenders()
    for function in found:
        print(function)
    assert not found, (f"{len(found)} function(s) over {MAX_LINES} lines with no `{MARK} <why>` comment above "
                       "the def or opening the body; split them, or say why not:\n" + "\n".join(map(str, found)))


def test_the_check_sees_a_long_function_and_its_reason(tmp_path: Path) -> None:
    def body(indent: str, count: int = MAX_LINES) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(count))

    plain = tmp_path / "plain.py"
    plain.write_text(f"def outer():\n    @staticmethod\n    def inner():\n{body(' ' * 8)}    return 1\n")
    assert [(f.name, f.reason) for f in long_functions(plain)] == [("outer", ""), ("inner", "")]

    above = tmp_path / "above.py"
    above.write_text(f"# Long: one table, read top to bottom\n@decorated\ndef table():\n{body('    ')}")
    opening = tmp_path / "opening.py"
    opening.write_text(f"def table(\n    a: int,\n) -> None:\n    # Long: one table, read top to bottom\n"
                       f"{body('    ')}")
    for path in (above, opening):
        assert [f.reason for f in long_functions(path)] == ["one table, read top to bottom"]

    no_reason = tmp_path / "no_reason.py"
    no_reason.write_text(f"# Long: yes\ndef table():\n{body('    ')}")
    buried = tmp_path / "buried.py"  # a mark deep in the body is not a reason given up front
    buried.write_text(f"def table():\n{body('    ')}    # Long: one table, read top to bottom\n    return 1\n")
    short = tmp_path / "short.py"
    short.write_text(f"def f():\n{body('    ', MAX_LINES - 1)}")
    assert [f.reason for f in long_functions(no_reason) + long_functions(buried)] == ["", ""]
    assert long_functions(short) == []


if __name__ == "__main__":
    listed = offenders()
    print("\n".join(map(str, listed)) or "none")
    sys.exit(1 if listed else 0)
