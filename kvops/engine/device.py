"""Where the engine runs: the `--device` setting resolved to a torch device, the dtype `auto` means there,
and, on CUDA, how much device memory the KV cache gets.

The budget arithmetic (`gpu_kv_budget`, `activation_headroom`) is pure so it can be tested with
made-up numbers on machines without a GPU; only `device_memory` asks the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import structlog
import torch

from kvops.engine.config import EngineConfig, format_bytes, parse_bytes
from kvops.engine.errors import CapacityError
from kvops.schema.errors import ConfigError

log = structlog.get_logger("kvops.engine.device")

# What --kv-cache-memory is when nobody set it. On CUDA that value means "not set": the budget then comes
# from --gpu-memory-utilization alone (a 512 MiB cap would waste almost all of a data-centre GPU).
DEFAULT_KV_CACHE_MEMORY = parse_bytes(next(f.default for f in fields(EngineConfig) if f.name == "kv_cache_memory"))

# Held back beside the estimated activations: cuBLAS workspaces, Triton's launch state, the caching
# allocator's rounding. A guess, not a measurement (nothing here has run on a GPU yet).
CUDA_MARGIN_BYTES = 512 * 2**20


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> a torch device (CUDA ones always with their index), or a ConfigError
    that says why the device cannot be used and what to use instead."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ConfigError(f"--device {name!r} is not a device kvops runs on: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"--device {name}: no CUDA device is visible to torch (torch {torch.__version__} is "
                          f"{build}); use --device cpu or auto, or install a CUDA build of torch on a machine "
                          "with an NVIDIA GPU")
    count = torch.cuda.device_count()
    index = int(name[5:]) if name.startswith("cuda:") else torch.cuda.current_device()
    if index >= count:
        raise ConfigError(f"--device {name}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1} "
                          "(CUDA_VISIBLE_DEVICES renumbers them); pick one of those")
    return torch.device("cuda", index)


def default_dtype(device: torch.device) -> torch.dtype:
    """--dtype auto: float32 on CPU (exact parity with transformers), bfloat16 on CUDA (tensor cores, half the
    memory; float16 would overflow on some checkpoints)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def activation_headroom(max_num_batched_tokens: int, max_num_seqs: int, hidden: int, intermediate: int,
                        q_size: int, kv_size: int, vocab: int, dtype_bytes: int) -> int:
    """Bytes to leave free for one step's activations: the tensors a layer holds at its peak for a full
    token budget, the logits of every sampled row (model dtype, then float32 twice in sampling), doubled
    for the allocator, plus a fixed margin. An estimate: the engine does not profile a dummy step."""
    per_token = (3 * hidden + 3 * (q_size + 2 * kv_size) + 3 * intermediate) * dtype_bytes
    logits = min(max_num_seqs, max_num_batched_tokens) * vocab * (dtype_bytes + 8)
    return 2 * (max_num_batched_tokens * per_token + logits) + CUDA_MARGIN_BYTES


@dataclass(frozen=True)
class GpuBudget:
    kv_bytes: int
    limited_by: str  # which bound decided: utilization, free memory, or --kv-cache-memory
    total: int
    free: int
    weights: int
    headroom: int
    utilization: float

    def describe(self) -> str:
        return (f"KV budget {format_bytes(self.kv_bytes)} ({self.limited_by}): device total "
                f"{format_bytes(self.total)}, free after weights {format_bytes(self.free)}, weights "
                f"{format_bytes(self.weights)}, activation headroom {format_bytes(self.headroom)}, "
                f"--gpu-memory-utilization {self.utilization}")


def gpu_kv_budget(total: int, free: int, weights: int, headroom: int, utilization: float,
                  requested: int | None = None) -> GpuBudget:
    """The KV cache's bytes on a CUDA device.

    `free` is measured with the weights already on the device, so it already excludes them (and the CUDA
    context, and other processes). Three bounds, the smallest wins: this process's share
    (utilization × total − weights − headroom, vLLM's meaning of the fraction), what is actually free
    (free − headroom: other processes may hold more than 1 − utilization), and --kv-cache-memory when
    the user gave it (`requested`).
    """
    bounds = {
        f"--gpu-memory-utilization {utilization}": int(utilization * total) - weights - headroom,
        "free device memory": free - headroom,
    }
    if requested is not None:
        bounds["--kv-cache-memory"] = requested
    limited_by = min(bounds, key=lambda name: bounds[name])
    budget = GpuBudget(bounds[limited_by], limited_by, total, free, weights, headroom, utilization)
    if budget.kv_bytes <= 0:
        raise CapacityError(
            f"no device memory is left for the KV cache: {budget.describe()}; raise --gpu-memory-utilization, "
            "free memory other processes hold on the device, or lower --max-num-batched-tokens / --max-num-seqs "
            "(they size the activation headroom)")
    return budget


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of a CUDA device, from NVML, else from the CUDA runtime.

    NVML is looked up by the device's UUID, not its index: CUDA_VISIBLE_DEVICES renumbers torch's devices
    but not NVML's. A MIG slice has no NVML handle by that UUID, and then the runtime answers for the slice.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.total), int(info.free)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no nvidia-ml-py, no driver library, a MIG slice, an old driver
        log.info("NVML memory read failed; asking the CUDA runtime", reason=str(exc)[:200])
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)


def plan_gpu_kv_budget(config: EngineConfig, device: torch.device, weights: int, headroom: int) -> GpuBudget:
    """The KV budget for this engine on `device`, logged with the numbers it came from."""
    torch.cuda.synchronize(device)
    total, free = device_memory(device)
    requested = None if config.kv_cache_memory == DEFAULT_KV_CACHE_MEMORY else int(config.kv_cache_memory)
    budget = gpu_kv_budget(total, free, weights, headroom, float(config.gpu_memory_utilization), requested)
    log.info(budget.describe(), device=str(device), kv_budget_bytes=budget.kv_bytes, total_bytes=total,
             free_bytes=free, weights_bytes=weights, headroom_bytes=headroom)
    return budget
