"""CPU and memory of this process (psutil) and GPU memory/utilization (NVML); no GPU is not an error."""

from __future__ import annotations

import os

import psutil

from kvops.schema.snapshot import GpuStats, ProcessStats

_process = psutil.Process(os.getpid())


def read_gpus() -> tuple[list[GpuStats], str]:
    try:
        import pynvml
    except ImportError:
        return [], "NVML unavailable: install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"no GPU ({exc})"
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(GpuStats(
                index=index,
                name=name.decode() if isinstance(name, bytes) else name,
                memory_used_bytes=int(memory.used),
                memory_total_bytes=int(memory.total),
                utilization_percent=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            ))
        return gpus, "ok" if gpus else "no GPU"
    except pynvml.NVMLError as exc:
        return [], f"NVML error: {exc}"
    finally:
        pynvml.nvmlShutdown()


def read_process_stats(include_gpu: bool = True) -> ProcessStats:
    with _process.oneshot():
        cpu = _process.cpu_percent(interval=None)
        rss = _process.memory_info().rss
        threads = _process.num_threads()
    gpus, status = read_gpus() if include_gpu else ([], "not read")
    return ProcessStats(cpu_percent=cpu, rss_bytes=rss, num_threads=threads, gpus=gpus, gpu_status=status)
