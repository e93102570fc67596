"""The architecture, tested: the import contracts in pyproject.toml, no private names across modules,
no torch for the commands that only watch remote engines, and modules of a readable size.

The contracts run on the tree itself (every package is the folder of its import name under kvops/);
from the command line, `lint-imports` in the checkout root does the same.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
SCANNED = ("kvops", "benchmarks")  # where no module may use another's private names
MAX_MODULE_LINES = 450


def lint_imports_executable() -> str | None:
    beside = Path(sys.executable).with_name("lint-imports")  # the one of this interpreter's environment
    return str(beside) if beside.is_file() else shutil.which("lint-imports")


def run_lint_imports(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """lint-imports on the kvops package under `tree` (the checkout, or a copy of its kvops/)."""
    executable = lint_imports_executable()
    assert executable is not None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([executable, str(PYPROJECT), "--no-cache", *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


# ------------------------------------------------------------------------------ import contracts


def contracts() -> list[dict[str, Any]]:
    return list(tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"])


def verdicts(output: str) -> dict[str, str]:
    """Each contract's name -> KEPT or BROKEN, from lint-imports' summary lines ("<name> KEPT",
    "<name> KEPT (3 ignored imports)", "<name> BROKEN")."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        match = re.fullmatch(r"(.+) (KEPT|BROKEN)(?: \(.*\))?", line.strip())
        if match:
            found[match.group(1)] = match.group(2)
    return found


def copy_of_the_package(dest: Path) -> Path:
    """`dest` holding a copy of kvops/, for the tests that plant a module without touching the checkout."""
    shutil.copytree(ROOT / "kvops", dest / "kvops", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def plant(tree: Path, module: str, source: str) -> None:
    """Write `module` (dotted, its package already in the tree) with `source`."""
    tree.joinpath(*module.split(".")).with_suffix(".py").write_text(source)


def test_import_contracts_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if lint_imports_executable() is None:
        pytest.skip("lint-imports (import-linter, in the test extra) is not installed")
    result = run_lint_imports(ROOT)
    found = verdicts(result.stdout)
    with capsys.disabled():  # in CI's log even when every contract holds
        print("\nimport contracts:\n" + "\n".join(f"  {verdict:6} {name}" for name, verdict in found.items()))
    assert sorted(found) == sorted(contract["name"] for contract in contracts()), \
        f"lint-imports did not report each contract of pyproject.toml:\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, f"lint-imports found broken contracts:\n{result.stdout}\n{result.stderr}"


def test_an_upward_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    """A KV events module that imports the rules (a layer above it, which never reaches back, so no cycle) is
    reported, by the layers contract alone."""
    if lint_imports_executable() is None:
        pytest.skip("lint-imports (import-linter, in the test extra) is not installed")
    tree = copy_of_the_package(tmp_path / "tree")
    plant(tree, "kvops.events.upward", "import kvops.rules\n")
    result = run_lint_imports(tree)
    layers = next(contract["name"] for contract in contracts() if contract["type"] == "layers")
    found = verdicts(result.stdout)
    assert result.returncode != 0
    assert found.pop(layers) == "BROKEN", result.stdout
    assert set(found.values()) == {"KEPT"}, result.stdout
    assert "kvops.events.upward -> kvops.rules" in result.stdout
    assert not (ROOT / "kvops" / "events" / "upward.py").exists()



def _contract(kind: str, name_has: str = "") -> str:
    return next(c["name"] for c in contracts() if c["type"] == kind and name_has in c["name"])


def test_a_cycle_between_packages_breaks_the_acyclic_contract(tmp_path: Path) -> None:
    """The KV events package importing the supervisor, which imports it: a cycle of two packages, reported by the
    acyclic contract as the arrow that would break it (and by the layers contract as an upward import)."""
    if lint_imports_executable() is None:
        pytest.skip("lint-imports (import-linter, in the test extra) is not installed")
    tree = copy_of_the_package(tmp_path / "tree")
    plant(tree, "kvops.events.upward", "import kvops.supervisor.config\n")
    result = run_lint_imports(tree)
    found = verdicts(result.stdout)
    assert result.returncode != 0
    assert found.pop(_contract("acyclic_siblings")) == "BROKEN", result.stdout
    assert found.pop(_contract("layers")) == "BROKEN", result.stdout
    assert set(found.values()) == {"KEPT"}, result.stdout
    assert ".events -> .supervisor" in result.stdout


def test_a_cycle_inside_a_package_breaks_the_acyclic_contract(tmp_path: Path) -> None:
    """Two modules of the engine naming each other's types, as the snapshot builder and the engine once did: the
    contract looks one level into each package (depth 1), so this is a cycle too, and no other contract minds it."""
    if lint_imports_executable() is None:
        pytest.skip("lint-imports (import-linter, in the test extra) is not installed")
    tree = copy_of_the_package(tmp_path / "tree")
    hinted = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import kvops.engine.{}\n"
    plant(tree, "kvops.engine.hinted_a", hinted.format("hinted_b"))
    plant(tree, "kvops.engine.hinted_b", hinted.format("hinted_a"))
    result = run_lint_imports(tree)
    found = verdicts(result.stdout)
    assert result.returncode != 0
    assert found.pop(_contract("acyclic_siblings")) == "BROKEN", result.stdout
    assert set(found.values()) == {"KEPT"}, result.stdout
    assert "hinted_" in result.stdout


def test_a_type_hint_import_up_the_stack_counts(tmp_path: Path) -> None:
    """A profile naming the supervisor's config under TYPE_CHECKING (how a launcher's types once made the kinds
    and the supervisor a cycle) breaks the layers, the acyclic and the profiles' purity contracts."""
    if lint_imports_executable() is None:
        pytest.skip("lint-imports (import-linter, in the test extra) is not installed")
    tree = copy_of_the_package(tmp_path / "tree")
    plant(tree, "kvops.kinds.hinted", "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                      "    from kvops.supervisor.engine_spec import EngineSpec\n")
    result = run_lint_imports(tree)
    found = verdicts(result.stdout)
    broken = {name for name, verdict in found.items() if verdict == "BROKEN"}
    assert broken == {_contract("layers"), _contract("acyclic_siblings"), _contract("forbidden", "profiles")}, \
        result.stdout
    assert "kvops.kinds.hinted -> kvops.supervisor.engine_spec" in result.stdout

def test_every_package_is_the_folder_of_its_import_name() -> None:
    """No package-dir mapping and no package list, and no package folder at the top of the checkout, where it
    would shadow a PyPI package of the same name whenever the checkout leads sys.path (a top-level `kernels/`
    once hid Hugging Face's `kernels` from transformers)."""
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools, setuptools["package-dir"]
    assert list(setuptools["packages"]) == ["find"], "packages are found, not listed: a list drifts"
    top = sorted(entry.name for entry in ROOT.iterdir()
                 if entry.is_dir() and (entry / "__init__.py").is_file() and entry.name not in ("kvops", "tests"))
    assert top == [], f"package folders at the top of the checkout: {top}"
    assert (ROOT / "kvops" / "engine" / "__init__.py").is_file()
    assert (ROOT / "kvops" / "kernels" / "__init__.py").is_file()


def test_the_checkout_root_shadows_nothing_transformers_imports() -> None:
    """`python -c` from the checkout root puts it first on sys.path; transformers must still find its own
    dependencies (Hugging Face's `kernels` among them), with no PYTHONSAFEPATH or -P to hide anything."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run([sys.executable, "-c", "import transformers.activations"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------------------ private names


def _modules() -> dict[str, Path]:
    """Every module of kvops by its dotted name."""
    found: dict[str, Path] = {}
    for file in (ROOT / "kvops").rglob("*.py"):
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = file
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(file: Path, modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """`from kvops.x import _name` (or of a private module), and `module._name` on a kvops module imported
    by name, each as `file:line: what`."""
    tree = ast.parse(file.read_text(), filename=str(file))
    where = file.relative_to(root)
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> the kvops module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            own = node.level > 0 or module.split(".")[0] == "kvops"  # another project's privates are its business
            if not own:
                continue
            source = "." * node.level + module
            if any(_private(part) for part in module.split(".")):
                found.append(f"{where}:{node.lineno}: from {source} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
                if node.level == 0 and f"{module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "kvops":
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                bound[alias.asname or "kvops"] = alias.name if alias.asname else "kvops"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and (base := _dotted(node.value)):
            head, _, rest = base.partition(".")
            if head in bound and ".".join(filter(None, [bound[head], rest])) in modules:
                found.append(f"{where}:{node.lineno}: {base}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    modules = _modules()
    offenders = [use for folder in SCANNED for file in sorted((ROOT / folder).rglob("*.py"))
                 for use in private_uses(file, modules)]
    assert not offenders, "private names used across modules (make them public where they are shared):\n" + \
        "\n".join(offenders)


def test_the_private_name_scan_finds_each_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from __future__ import annotations\n"
                      "from kvops.bench.report import _fmt, log\n"
                      "from kvops.bench import report\n"
                      "import kvops.bench.workloads as workloads\n"
                      "import kvops.bench.peers\n"
                      "from kvops.bench.report import __doc__\n"
                      "from pydantic import _internal\n"
                      "report._fmt(1), workloads._log_uniform, kvops.bench.peers._cb_per_request, report.log\n")
    assert sorted(private_uses(sample, _modules(), root=tmp_path)) == [
        "sample.py:2: from kvops.bench.report import _fmt",
        "sample.py:8: kvops.bench.peers._cb_per_request",
        "sample.py:8: report._fmt",
        "sample.py:8: workloads._log_uniform",
    ]


# ------------------------------------------------------------------------------ no torch for watching

# Records which module first imported each module, so a failure names the chain that pulled torch in.
PROBE = """
import sys

IMPORTED_BY = {}


class Recorder:
    def find_spec(self, name, path=None, target=None):
        if name not in IMPORTED_BY:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
                frame = frame.f_back
            IMPORTED_BY[name] = frame.f_globals.get("__name__", "?") if frame is not None else "?"
        return None


sys.meta_path.insert(0, Recorder())
%s
if "torch" in sys.modules:
    chain = ["torch"]
    while chain[-1] in IMPORTED_BY and IMPORTED_BY[chain[-1]] not in chain:
        chain.append(IMPORTED_BY[chain[-1]])
    print("torch was imported: " + " <- ".join(chain), file=sys.stderr)
    sys.exit(3)
"""


def _closed_port() -> int:
    """A port nothing listens on (bound once by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cli(argv: list[str]) -> str:
    return f"from kvops.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"


def _watching(case: str, tmp_path: Path) -> str:
    url = f"http://127.0.0.1:{_closed_port()}"
    if case == "doctor":
        return _cli(["doctor", "--url", url])
    if case == "top":
        return _cli(["top", "--once", "--attach", url])
    if case == "gateway":  # the gateway in front of a remote vLLM, built as `kvops gateway` builds it (not served)
        return ("from kvops.cli import build_parser\n"
                "from kvops.gateway.app import build_gateway_app\n"
                "from kvops.gateway.run import build_from_args\n"
                f"args = build_parser().parse_args(['gateway', '--upstream', {url!r}])\n"
                "build_gateway_app(build_from_args(args))\n")
    config = tmp_path / "kvops.toml"
    config.write_text(f'[supervisor]\nstate_dir = "{tmp_path / "state"}"\n\n'
                      f'[[engines]]\nname = "remote"\nurl = "{url}"\nmanaged = false\n')
    if case == "run":
        return _cli(["run", "--config", str(config), "--check-config"])
    # The supervisor itself, built for that config as `kvops run` builds it (not started: no polling).
    return ("from kvops.supervisor.api import build_supervisor_app\n"
            "from kvops.supervisor.config import load_config\n"
            "from kvops.supervisor.supervisor import Supervisor\n"
            f"supervisor = Supervisor(load_config({str(config)!r}))\n"
            "build_supervisor_app(supervisor)\n")


@pytest.mark.parametrize("case", ["doctor", "top", "run", "supervisor", "gateway"])
def test_watching_remote_engines_does_not_import_torch(case: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", PROBE % _watching(case, tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{case}: {result.stderr.strip().splitlines()[-1:] or result.stderr}\n" \
                                   f"{result.stderr}"


# ------------------------------------------------------------------------------ module size


def test_modules_are_small_enough_to_read() -> None:
    sizes = {file.relative_to(ROOT): len(file.read_text().splitlines())
             for file in (ROOT / "kvops").rglob("*.py")}
    offenders = [f"{path}: {lines} lines" for path, lines in sorted(sizes.items()) if lines > MAX_MODULE_LINES]
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split them by job):\n" + "\n".join(offenders)


if __name__ == "__main__":
    if lint_imports_executable() is None:
        sys.exit("lint-imports is not installed: pip install -e '.[test]'")
    outcome = run_lint_imports(ROOT, *sys.argv[1:])
    print(outcome.stdout, end="")
    print(outcome.stderr, end="", file=sys.stderr)
    sys.exit(outcome.returncode)
