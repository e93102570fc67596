"""Environment: the Python stack kvops runs on, and the GPU (or a clear "no GPU", which is not a failure:
the engine runs on the CPU)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from types import ModuleType

from kvops.doctor.report import Check, Status
from kvops.kinds import Capability, profile_of
from kvops.schema.snapshot import GpuStats, Snapshot

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


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f}"


def _busy(gpu: GpuStats) -> str:
    return f"{gpu.utilization_percent:.0f}% busy" if gpu.utilization_known else "utilization not reported"


def gpu_line(gpu: GpuStats) -> str:
    """One GPU as doctor shows it: device, memory by kvops / others / free, utilization. A split that was not
    read shows as "?" (never as 0 GiB)."""
    memory = f"{_gib(gpu.memory_total_bytes)} GiB"
    if gpu.memory_kvops_bytes is not None:
        memory += f": kvops {_gib(gpu.memory_kvops_bytes)}, others {_gib(gpu.memory_others_bytes)}"
    else:
        memory += f": used {_gib(gpu.memory_used_bytes)} (kvops's share not read)"
    return f"GPU {gpu.index} {gpu.name}, {memory}, free {_gib(gpu.free_bytes)} GiB; {_busy(gpu)}"


def _local_gpus(pynvml: ModuleType) -> list[str]:
    lines = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        try:
            busy = f"{pynvml.nvmlDeviceGetUtilizationRates(handle).gpu:.0f}% busy"
        except Exception:  # NotSupported on MIG slices: memory is still worth showing
            busy = "utilization not reported"
        lines.append(f"{index}: {name.decode() if isinstance(name, bytes) else name}, "
                     f"{memory.used / 2**30:.1f}/{memory.total / 2**30:.1f} GiB used, "
                     f"{memory.free / 2**30:.1f} GiB free; {busy}")
    return lines


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
            driver = driver.decode() if isinstance(driver, bytes) else driver
            gpus = _local_gpus(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        detail.append(f"NVML: {type(exc).__name__}: {exc}")
        if cuda:
            return Check(section=SECTION, title="GPU", status=Status.WARN,
                         evidence=f"CUDA works but NVML is unavailable ({exc}): no GPU memory or utilization in "
                                  "snapshots", remedy="pip install nvidia-ml-py, and check the driver (nvidia-smi)",
                         detail=detail)
        return Check(section=SECTION, title="GPU", status=Status.INFO,
                     evidence=f"no GPU (NVML unavailable: {exc}; CUDA unavailable): the engine runs on the CPU",
                     detail=detail)
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
    """The engine's device and GPU, from its snapshot (the machine doctor runs on says nothing about it)."""
    if not snap.knows("engine.device") and not snap.knows("process.gpus"):
        return Check(section=SECTION, title="Engine device", status=Status.SKIPPED,
                     evidence=f"{snap.source} does not export its device or GPU memory in /metrics")
    process, device = snap.process, snap.engine.device
    gpus = process.engine_gpus()
    if not gpus:
        # No GPU facts: say why (the snapshot's gpu_status), not zeros. A kvops engine on CUDA whose NVML read
        # failed is worth a look; a kind read from /metrics, which never reports its GPU, is not.
        cuda = (device.startswith("cuda") and snap.knows("process.gpus") and profile_of(snap).can(Capability.STATS)
                and process.gpu_status != "not read")
        return Check(section=SECTION, title="Engine device", status=Status.WARN if cuda else Status.INFO,
                     evidence=f"{device}, {snap.engine.dtype}; GPU: {process.gpu_status}",
                     remedy="install nvidia-ml-py where the engine runs, and check the driver (nvidia-smi)"
                     if cuda else "")
    detail = [gpu_line(gpu) for gpu in process.gpus if gpu not in gpus]  # the host's other GPUs, for context
    detail += [f"GPU {gpu.index}: kvops's memory is torch's reserved memory (NVML does not list the engine's pid, "
               "e.g. in a container); the CUDA context is not in it" for gpu in gpus
               if gpu.memory_kvops_source == "torch"]
    return Check(section=SECTION, title="Engine device", status=Status.OK,
                 evidence=f"{device}, {snap.engine.dtype}; " + "; ".join(gpu_line(gpu) for gpu in gpus),
                 detail=detail)
