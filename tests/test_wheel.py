"""The wheel as `pip install .` builds it: every package and data file in it, and the commands run from it.

The rest of the suite runs on the editable install, which reads the checkout and so hides a package the wheel
lacks (a hand-kept package list once left kvops.fleet out: `kvops top --prometheus` ended in a traceback).
Here the wheel is built from a copy of the sources, unpacked into a folder of its own, and run from there with
the checkout nowhere on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_SUFFIXES = (".cpp", ".h", ".tcss")  # pyproject.toml's package-data
CLOSED_PORT_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources (an in-tree build would leave build/ in the checkout, and
    reuse it next time)."""
    scratch = tmp_path_factory.mktemp("wheel")
    source = scratch / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "kvops", source / "kvops", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = scratch / "dist"
    # No build isolation: it would fetch setuptools; the test extra installs it.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(source)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("kvops-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked (what pip installs into site-packages), as a folder to put first on sys.path."""
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def _wheel_env(installed: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(installed)}


def _run_from_wheel(installed: Path, code: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -c code` with the unpacked wheel first on sys.path, from a folder outside the checkout."""
    return subprocess.run([sys.executable, "-c", code], cwd=installed.parent, env=_wheel_env(installed),
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def test_every_package_folder_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(str(init.parent.relative_to(ROOT)) for init in (ROOT / "kvops").rglob("__init__.py"))
    assert "kvops/engine" in packages and "kvops/fleet" in packages  # the scan sees the tree
    missing = [package for package in packages if f"{package}/__init__.py" not in names]
    assert not missing, f"package folders the wheel lacks: {missing}"
    modules = sorted(str(file.relative_to(ROOT)) for file in (ROOT / "kvops").rglob("*.py"))
    assert [module for module in modules if module not in names] == []


def test_every_package_data_file_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(str(file.relative_to(ROOT)) for file in (ROOT / "kvops").rglob("*")
                  if file.suffix in DATA_SUFFIXES)
    assert "kvops/engine/step_kernels.cpp" in data and "kvops/top/top.tcss" in data
    assert [file for file in data if file not in names] == []


def test_the_wheel_holds_nothing_but_kvops(wheel: Path) -> None:
    """No other top-level package (a folder shipped as `engine` or `kernels` would shadow PyPI's)."""
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"kvops"}


def test_every_module_imports_from_the_wheel(installed: Path) -> None:
    """Each module the CLI imports lazily, and every other one, from the unpacked wheel (not the checkout)."""
    code = (
        "import importlib, pkgutil, kvops\n"
        f"assert kvops.__file__.startswith({str(installed)!r}), kvops.__file__\n"
        "failed = []\n"
        "for info in pkgutil.walk_packages(kvops.__path__, 'kvops.'):\n"
        "    if info.name == 'kvops.__main__':\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(info.name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{info.name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed) or 'ok')\n"
    )
    done = _run_from_wheel(installed, code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok", done.stdout


@pytest.mark.parametrize("command", [["top", "--prometheus", CLOSED_PORT_URL, "--once"],
                                     ["doctor", "--prometheus", CLOSED_PORT_URL]])
def test_fleet_commands_say_prometheus_is_not_answering(installed: Path, command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "kvops", *command], cwd=installed.parent,
                          env=_wheel_env(installed), capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    assert done.returncode == 2, output
    assert f"nothing answers at {CLOSED_PORT_URL}" in output and "is Prometheus running there?" in output, output
