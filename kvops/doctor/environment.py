"""Environment: the Python stack kvops runs on, and the GPU (or a clear "no GPU", which is not a failure:
the engine runs on the CPU)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

from kvops.doctor.report import Check, Status
from kvops.schema.snapshot import Snapshot

SECTION = "Environment"
MIN_PYTHON = (3, 11)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def python_stack() -> list[Check]:
    checks = []
    py = platform.python_version()
    ok = sys.version_info >= MIN_PYTHON
    checks.append(Check(section=SECTION, title="Python", status=Status.OK if ok else Status.FAIL,
                        evidence=f"{py} ({sys.executable})",
                        remedy="" if ok else f"kvops needs Python {'.'.join(map(str, MIN_PYTHON))} or later"))
    versions = {name: _version(name) for name in ("torch", "transformers", "triton")}
    missing = [name for name in ("torch", "transformers") if versions[name] is None]
    evidence = ", ".join(f"{name} {v}" if v else f"{name} not installed" for name, v in versions.items())
    checks.append(Check(
        section=SECTION, title="Packages", status=Status.FAIL if missing else Status.OK, evidence=evidence,
        remedy=f"pip install {' '.join(missing)}" if missing else "",
        detail=["triton is optional: without it (or without CUDA) the torch reference kernels are used"]))
    return checks


def accelerator() -> Check:
    """CUDA through torch, the GPU through NVML (`nvidia-ml-py`); absent means "no GPU", never a crash."""
    detail: list[str] = []
    try:
        import torch

        cuda = torch.cuda.is_available()
        detail.append(f"torch CUDA build: {torch.version.cuda or 'none (CPU build)'}; available: {cuda}")
    except Exception as exc:  # a broken torch install must not stop the other checks
        return Check(section=SECTION, title="GPU", status=Status.FAIL, evidence=f"torch does not import: {exc}",
                     remedy="reinstall torch: pip install torch")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                gpus.append(f"{index}: {name}, {memory.used / 2**30:.1f}/{memory.total / 2**30:.1f} GiB used")
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        detail.append(f"NVML: {type(exc).__name__}: {exc}")
        if cuda:
            return Check(section=SECTION, title="GPU", status=Status.WARN,
                         evidence="CUDA works but NVML does not answer: no GPU memory or utilization in snapshots",
                         remedy="pip install nvidia-ml-py, and check the driver (nvidia-smi)", detail=detail)
        return Check(section=SECTION, title="GPU", status=Status.INFO,
                     evidence="no GPU (no NVIDIA driver, CUDA unavailable): the engine runs on the CPU", detail=detail)
    detail.append(f"driver {driver}")
    detail.extend(gpus)
    if not gpus:
        return Check(section=SECTION, title="GPU", status=Status.INFO, evidence=f"driver {driver}, but no GPU",
                     detail=detail)
    if not cuda:
        return Check(section=SECTION, title="GPU", status=Status.WARN,
                     evidence=f"{len(gpus)} GPU(s), driver {driver}, but this torch cannot use CUDA",
                     remedy="install a CUDA build of torch matching the driver", detail=detail)
    return Check(section=SECTION, title="GPU", status=Status.OK, evidence=f"{gpus[0]}; driver {driver}"
                 + (f" (+{len(gpus) - 1} more)" if len(gpus) > 1 else ""), detail=detail)


def engine_device(snap: Snapshot) -> Check:
    """A remote engine's device, from its snapshot (the local machine says nothing about it)."""
    if not snap.knows("engine.device") and not snap.knows("process.gpus"):
        return Check(section=SECTION, title="Engine device", status=Status.SKIPPED,
                     evidence=f"{snap.source} does not export its device or GPU memory in /metrics")
    gpus = "; ".join(f"{g.name} {g.memory_used_bytes / 2**30:.1f}/{g.memory_total_bytes / 2**30:.1f} GiB"
                     for g in snap.process.gpus)
    return Check(section=SECTION, title="Engine device", status=Status.OK if gpus else Status.INFO,
                 evidence=f"{snap.engine.device}, {snap.engine.dtype}; GPU: {gpus or snap.process.gpu_status}")
