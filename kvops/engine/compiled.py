"""The compiled engine step (`--compile auto|on|off`): kvops/engine/step_*.cpp, built at engine start.

On CPU the unfused decode step runs ~35 small ops a layer from Python and gathers every sequence's K/V into a
copy before attending; the compiled ops fuse the glue between the matmuls and read K/V in place in the paged
cache (docs/engine.md, "The compiled step"). The install stays compile-free: the library is built the first
time an engine starts with compile on, by the machine's C++ compiler against the installed torch's headers,
and kept in the cache directory (`kvops.engine.weights.cache_root()`/compiled). The key is everything the
built file depends on: the sources, kvops's and torch's versions, the compiler and the CPU it was tuned for
(`-march=native`). The ops take any model shape and float32 or bfloat16, so a second model or dtype reuses
it. Concurrent first starts build once: the second waits on a lock and then loads what the first built.

`auto` compiles on CPU where a compiler is present and says in one log line why not otherwise (no compiler,
a CUDA device, the Triton kernels forced on CPU, a failed build); `on` refuses to start instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import structlog
import torch

from kvops import __version__
from kvops.engine.config import COMPILE_MODES
from kvops.engine.weights import cache_root
from kvops.schema.errors import ConfigError

log = structlog.get_logger("kvops.engine.compiled")

# step_kernels.cpp (the glue ops, the one call for all layers and the ops' registration), step_attention.cpp,
# step_matmul.cpp, and the header they share: one library.
SOURCES = tuple(sorted(Path(__file__).parent.glob("step_*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("step_*.h")))
NAMESPACE = "kvops_step"  # TORCH_LIBRARY's namespace in the source: the ops are torch.ops.kvops_step.*
BUILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class CompiledStep:
    """What `--compile` gave this engine: `state` built (compiled now), cached (loaded a build from an earlier
    start) or off; `seconds` the time it took (the snapshot's compile_s); `reason` why off, else the library."""

    state: str
    seconds: float
    reason: str
    ops: Any = None  # torch.ops.kvops_step when on

    @property
    def on(self) -> bool:
        return self.ops is not None


def compiler() -> str | None:
    """The C++ compiler builds use: $CXX, else c++ or g++ on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu() -> str:
    """The CPU a `-march=native` build is tuned for: model name and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return " ".join(fields.get(key, "").strip() for key in ("model name", "flags"))


def cache_key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    parts = [*(path.read_bytes() for path in SOURCES + HEADERS), __version__.encode(), torch.__version__.encode(),
             version.encode(), _cpu().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _commands(cxx: str, scratch: Path, output: Path) -> tuple[list[list[str]], list[str]]:
    """One compile per source (run side by side: 19 against 31 s one after another, on two cores), then the link."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -ffp-contract=off: no fused multiply-adds, so RoPE's products and sums round as the unfused step's do.
    # -fopenmp: at::parallel_for is inline OpenMP; the loader resolves libgomp.so.1 to the one torch loaded.
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-fopenmp", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths())]
    objects = [scratch / f"{source.stem}.o" for source in SOURCES]
    compiles = [[cxx, *flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(SOURCES, objects, strict=True)]
    link = [cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(output),
            *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"]
    return compiles, link


def _run(commands: list[list[str]], cxx: str) -> None:
    """Run the commands side by side; the first failure, or a run past BUILD_TIMEOUT_S, raises RuntimeError."""
    running = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for command in commands]
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        for process in running:
            try:
                _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{cxx} took more than {BUILD_TIMEOUT_S} s") from None
            if process.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({process.returncode}): {stderr.strip()[-1500:]}")
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()


def build(directory: Path, cxx: str) -> tuple[Path, bool]:
    """The library for these sources, torch, compiler and CPU: (path, whether it was built now)."""
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{NAMESPACE}-{cache_key(cxx)}.so"
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent start builds it once; the other loads that build
        if library.exists():
            return library, False
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            partial = Path(scratch) / library.name
            compiles, link = _commands(cxx, Path(scratch), partial)
            _run(compiles, cxx)
            _run([link], cxx)
            os.replace(partial, library)  # whole or absent: a killed build leaves nothing to load
        return library, True


@cache
def _load(library: str) -> Any:
    """Load once per process: a second TORCH_LIBRARY for the namespace would be refused."""
    torch.ops.load_library(library)
    return getattr(torch.ops, NAMESPACE)


def unavailable(device: torch.device, kernel_backend: str) -> str | None:
    """Why this engine cannot run the compiled step, or None."""
    if device.type != "cpu":
        return f"the compiled step is for CPUs; on {device.type} the Triton kernels run"
    if kernel_backend != "torch":
        return f"KVOPS_KERNELS={kernel_backend} asks for the {kernel_backend} kernels"
    if sys.platform != "linux":
        return f"builds are made on Linux only (this is {sys.platform})"
    if compiler() is None:
        return "no C++ compiler (set CXX, or install g++: apt install g++)"
    return None


def compile_step(mode: str, device: torch.device, kernel_backend: str,
                 directory: Path | None = None) -> CompiledStep:
    """Build or load the compiled step as `mode` says; `auto` falls back with one log line, `on` refuses."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"--compile {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "off":
        return CompiledStep("off", 0.0, "--compile off")
    started = time.monotonic()
    why = unavailable(device, kernel_backend)
    if why is None:
        cxx = compiler()
        assert cxx is not None
        try:
            library, built = build(directory or cache_root() / "compiled", cxx)
            ops = _load(str(library))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            why = f"the build failed: {exc}"
        else:
            step = CompiledStep("built" if built else "cached", round(time.monotonic() - started, 3), str(library),
                                ops)
            log.info("compiled step " + ("built" if built else "loaded from the cache"), library=str(library),
                     compile_s=step.seconds)
            return step
    if mode == "on":
        raise ConfigError(f"--compile on, but {why}: use --compile auto (falls back to the unfused step) or off")
    log.warning("compiled step off: " + why + " (--compile auto falls back to the unfused step)")
    return CompiledStep("off", round(time.monotonic() - started, 3), why)
