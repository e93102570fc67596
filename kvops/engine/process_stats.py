"""CPU and memory of this process (psutil) and the GPUs' memory and utilization (NVML, `nvidia-ml-py`).

No GPU is not an error: the snapshot then carries no GPUs and `gpu_status` says why. NVML is initialised
once per process (`Nvml`), so a snapshot costs only a few cheap reads per GPU, and nothing NVML raises
leaves this module: a snapshot must never fail because the driver misbehaves.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any

import psutil

from kvops.schema.snapshot import GPU_STATUS_OK, GpuStats, ProcessStats

_process = psutil.Process(os.getpid())

# NVML_VALUE_NOT_AVAILABLE as the unsigned long long usedGpuMemory holds it: the driver does not know (Windows
# WDDM, some containers), which is not "uses nothing".
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
PROCESS_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _uuid_key(uuid: str) -> str:
    # NVML says "GPU-<uuid>", torch's device properties "<uuid>": compare without the prefix.
    return uuid.removeprefix("GPU-").lower()


def _torch_cuda() -> Any | None:
    """torch.cuda when the engine has already initialised CUDA; None otherwise. Never imports torch or starts
    CUDA itself: a CPU engine must not pay for (or crash on) a CUDA context because of a snapshot."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda if torch is not None and torch.cuda.is_initialized() else None
    except Exception:
        return None


def _torch_index(device: str) -> int:
    _, _, index = device.partition(":")
    if index.isdigit():
        return int(index)
    cuda = _torch_cuda()
    try:
        return int(cuda.current_device()) if cuda is not None else 0
    except Exception:
        return 0


class Nvml:
    """NVML for this process: initialised on the first GPU read and kept (NVML counts its inits, so the
    init/shutdown pairs elsewhere, e.g. kvops/engine/device.py, leave it running). A failed init is remembered rather
    than retried per snapshot: a driver does not appear while the engine runs. Reads are serialised, because
    `/stats` and `/metrics` may build snapshots at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None  # the process that initialised NVML: a forked child starts over
        self._reset()

    def _reset(self) -> None:
        self._nvml: ModuleType | None = None
        self._error: str | None = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._uuids: list[str] = []
        self._engine_index: dict[str, int | None] = {}  # device string -> NVML index (resolved once)

    def _start(self) -> str | None:
        """Initialise NVML and list the GPUs unless done; the status to report when that failed."""
        if self._pid != os.getpid():
            self._reset()  # a fork: the parent's NVML state is not ours
            self._pid = os.getpid()
        if self._error is not None or self._handles:
            return self._error
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                self._error = "NVML unavailable: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return self._error
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # no driver library, driver not loaded, no permission
                self._error = f"NVML unavailable: {_reason(exc)}"
                return self._error
            self._nvml = pynvml
        # Listing may fail while init worked (a GPU fallen off the bus): reported, and tried again next read.
        nvml = self._nvml
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in handles]
        self._uuids = [self._uuid(h) for h in handles]
        self._handles = handles
        return None

    def _uuid(self, handle: Any) -> str:
        try:
            return _uuid_key(_text(self._nvml.nvmlDeviceGetUUID(handle)))  # type: ignore[union-attr]
        except Exception:  # only used to match torch's device: without it the index is used
            return ""

    def read(self, device: str | None) -> tuple[list[GpuStats], str]:
        """Every GPU NVML sees, the engine's flagged, and the status. `device` is torch's name for the engine's
        device; None: not known, and the GPU that lists this process is taken for the engine's."""
        with self._lock:
            try:
                error = self._start()
                if error is not None:
                    return [], error
                if not self._handles:
                    return [], "no GPU: NVML sees no device"
                engine_index = self._nvml_index(device)
                return [self._read_one(i, engine_index, device) for i in range(len(self._handles))], GPU_STATUS_OK
            except Exception as exc:  # anything NVML (or a stand-in) raises becomes the status, never the caller's
                return [], f"NVML error: {_reason(exc)}"

    def _nvml_index(self, device: str | None) -> int | None:
        """NVML's index of torch's `device`: by UUID when CUDA is up, else through CUDA_VISIBLE_DEVICES, which
        renumbers torch's devices but not NVML's. None: not found (then the GPU holding our pid is flagged)."""
        if device is None:
            return None
        if device in self._engine_index:
            return self._engine_index[device]
        index = _torch_index(device)
        found: int | None = None
        cuda = _torch_cuda()
        try:
            uuid = _uuid_key(str(cuda.get_device_properties(index).uuid)) if cuda is not None else ""
        except Exception:
            uuid = ""
        if uuid and uuid in self._uuids:
            found = self._uuids.index(uuid)
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            entries = [e.strip() for e in visible.split(",") if e.strip()] if visible is not None else None
            if entries is None:
                found = index if index < len(self._handles) else None
            elif index < len(entries):
                entry = entries[index]
                key = _uuid_key(entry)
                matches = [i for i, u in enumerate(self._uuids) if u and u.startswith(key)]
                # CUDA takes a UUID prefix when it names one GPU only
                found = int(entry) if entry.isdigit() else matches[0] if len(matches) == 1 else None
        self._engine_index[device] = found
        return found

    def _read_one(self, index: int, engine_index: int | None, device: str | None) -> GpuStats:
        nvml, handle = self._nvml, self._handles[index]
        assert nvml is not None
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        used, total = int(memory.used), int(memory.total)
        try:
            utilization, utilization_known = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu), True
        except Exception:  # NotSupported on MIG slices and some vGPUs: the memory facts still count
            utilization, utilization_known = 0.0, False
        ours, listed = self._our_memory(handle)
        is_engine = index == engine_index if engine_index is not None else ours is not None
        source = "nvml" if ours is not None else ""
        if ours is None and is_engine and device is not None:
            ours = _torch_reserved(device)
            source = "torch" if ours is not None else ""
        elif ours is None and listed:
            ours, source = 0, "nvml"  # the lists were read and our pid is not on this GPU
        return GpuStats(
            index=index, name=self._names[index], memory_used_bytes=used, memory_total_bytes=total,
            memory_free_bytes=int(memory.free), utilization_percent=utilization, utilization_known=utilization_known,
            memory_kvops_bytes=ours, memory_others_bytes=None if ours is None else max(0, used - ours),
            memory_kvops_source=source, engine_device=is_engine)

    def _our_memory(self, handle: Any) -> tuple[int | None, bool]:
        """(memory NVML lists for this process on the GPU, or None; whether any process list could be read).
        A process in both the compute and the graphics list is one allocation, counted once."""
        pid, ours, listed = os.getpid(), None, False
        for name in PROCESS_LISTS:
            getter = getattr(self._nvml, name, None)
            if getter is None:
                continue
            try:
                processes = getter(handle)
            except Exception:  # NotSupported, or a driver too old for this call version
                continue
            listed = True
            for process in processes:
                memory = getattr(process, "usedGpuMemory", None)
                if process.pid == pid and memory is not None and int(memory) < NVML_VALUE_NOT_AVAILABLE:
                    ours = max(ours or 0, int(memory))
        return ours, listed


def _torch_reserved(device: str) -> int | None:
    """What torch's caching allocator holds on `device`: NVML's per-process figure minus the CUDA context."""
    cuda = _torch_cuda()
    try:
        return int(cuda.memory_reserved(_torch_index(device))) if cuda is not None else None
    except Exception:
        return None


_nvml = Nvml()


def read_gpus(device: str | None) -> tuple[list[GpuStats], str]:
    """The GPUs and `gpu_status` for an engine on `device` (torch's name: cpu, cuda, cuda:N). None: the caller
    does not know; the CPU unless torch has started CUDA (the engine picks cuda:N without making it current,
    so the GPU listing this process is taken for its own)."""
    if device is None and _torch_cuda() is None:
        device = "cpu"
    if device is not None and not device.startswith("cuda"):
        return [], f"no GPU: the engine runs on {device}"
    return _nvml.read(device)


def read_process_stats(include_gpu: bool = True, device: str | None = None, torch_threads: int | None = None,
                       others_busy_cpus: float | None = None) -> ProcessStats:
    """This process's stats; `device`: the engine's torch device (pass it: see `read_gpus` for None);
    `torch_threads` and `others_busy_cpus`: the engine's thread governor's (kvops.engine.threads)."""
    with _process.oneshot():
        cpu = _process.cpu_percent(interval=None)
        rss = _process.memory_info().rss
        threads = _process.num_threads()
    gpus, status = read_gpus(device) if include_gpu else ([], "not read")
    return ProcessStats(cpu_percent=cpu, rss_bytes=rss, num_threads=threads, torch_threads=torch_threads,
                        others_busy_cpus=others_busy_cpus, gpus=gpus, gpu_status=status)
