"""GPU facts: NVML read into the snapshot, and shown by /metrics, the supervisor, doctor and top.

There is no GPU on the machines these tests run on, so NVML is `FakeNvml`: a stand-in `pynvml` module with
just the functions kvops calls, put in `sys.modules` for the test. It checks kvops's mapping (which GPU is
the engine's, the kvops/others split, errors into `gpu_status`), not NVML itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from rich.text import Text

from kvops.doctor.environment import engine_device
from kvops.doctor.report import Status
from kvops.engine import process_stats
from kvops.engine.serving.metrics import EngineMetrics
from kvops.schema.snapshot import GpuStats, ProcessStats, Snapshot
from kvops.supervisor import exporter
from kvops.top.widgets.engines import gpu_compact, gpu_summary
from tests.helpers.synthetic import snapshot

GiB = 2**30
DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
OTHER_PID = 999_999


class NVMLError(Exception):
    """pynvml's exception base class, as the stand-in raises it."""


class FakeNvml(ModuleType):
    """A stand-in for `pynvml` (no GPU here): two H200s; the engine's pid and another process on GPU 1, the
    other process alone on GPU 0. Attributes set per test make a call fail or change what it returns."""

    NVMLError = NVMLError

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.calls: dict[str, int] = {}
        self.init_error: Exception | None = None
        self.memory_error: Exception | None = None
        self.utilization_error: Exception | None = None
        self.lists_error: Exception | None = None
        self.used = [30 * GiB, 80 * GiB]
        self.total = 141 * GiB
        self.processes: list[list[SimpleNamespace]] = [
            [SimpleNamespace(pid=OTHER_PID, usedGpuMemory=30 * GiB)],
            [SimpleNamespace(pid=os.getpid(), usedGpuMemory=60 * GiB),
             SimpleNamespace(pid=OTHER_PID, usedGpuMemory=20 * GiB)],
        ]

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self) -> None:
        self._count("init")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self._count("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._count("count")
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes | str:
        return b"NVIDIA H200" if handle == 0 else "NVIDIA H200"  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-0000000{handle}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._count("memory")
        if self.memory_error is not None:
            raise self.memory_error
        used = self.used[handle]
        return SimpleNamespace(total=self.total, used=used, free=self.total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        if self.utilization_error is not None:
            raise self.utilization_error
        return SimpleNamespace(gpu=[5, 37][handle], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        if self.lists_error is not None:
            raise self.lists_error
        return self.processes[handle]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        if self.lists_error is not None:
            raise self.lists_error
        return [p for p in self.processes[handle] if p.pid == os.getpid()]  # listed in both: counted once


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(process_stats, "_nvml", process_stats.Nvml())  # NVML state is per process: start fresh
    monkeypatch.setattr(process_stats, "_torch_cuda", lambda: None)  # CUDA never started (CPU torch here)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def by_index(gpus: list[GpuStats]) -> dict[int, GpuStats]:
    return {gpu.index: gpu for gpu in gpus}


# ----------------------------------------------------------------- reading NVML


def test_two_gpus_the_engine_on_index_1_splits_kvops_from_others(nvml: FakeNvml) -> None:
    stats = process_stats.read_process_stats(device="cuda:1")
    assert stats.gpu_status == "ok"
    gpus = by_index(stats.gpus)
    ours, other = gpus[1], gpus[0]
    assert ours.engine_device and not other.engine_device
    assert ours.name == "NVIDIA H200" and other.name == "NVIDIA H200"  # bytes decoded
    assert (ours.memory_total_bytes, ours.memory_used_bytes, ours.memory_free_bytes) == (141 * GiB, 80 * GiB,
                                                                                       61 * GiB)
    assert (ours.memory_kvops_bytes, ours.memory_others_bytes, ours.memory_kvops_source) == (60 * GiB, 20 * GiB,
                                                                                          "nvml")
    assert ours.utilization_percent == 37 and ours.utilization_known
    # GPU 0: the lists were read and the engine's pid is not on it
    assert (other.memory_kvops_bytes, other.memory_others_bytes) == (0, 30 * GiB)
    assert stats.engine_gpus() == [ours]


def test_nvml_is_initialised_once_and_each_snapshot_only_reads(nvml: FakeNvml) -> None:
    for _ in range(5):
        assert process_stats.read_process_stats(device="cuda:1").gpu_status == "ok"
    assert nvml.calls["init"] == 1 and nvml.calls["count"] == 1
    assert nvml.calls.get("shutdown", 0) == 0
    assert nvml.calls["memory"] == 5 * 2


def test_cuda_visible_devices_renumbers_torch_but_not_nvml(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus = by_index(process_stats.read_process_stats(device="cuda:0").gpus)
    assert gpus[1].engine_device and not gpus[0].engine_device
    monkeypatch.setattr(process_stats, "_nvml", process_stats.Nvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000001-aaaa")  # a UUID prefix names the GPU too
    gpus = by_index(process_stats.read_process_stats(device="cuda:0").gpus)
    assert gpus[1].engine_device and not gpus[0].engine_device


def test_torch_uuid_finds_the_engine_gpu(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = SimpleNamespace(current_device=lambda: 0, memory_reserved=lambda index: 0,
                           get_device_properties=lambda index: SimpleNamespace(
                               uuid="00000001-aaaa-bbbb-cccc-dddddddddddd"))
    monkeypatch.setattr(process_stats, "_torch_cuda", lambda: cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-or-something-unmatched")  # the UUID wins
    gpus = by_index(process_stats.read_process_stats(device="cuda:0").gpus)
    assert gpus[1].engine_device and not gpus[0].engine_device


def test_an_unknown_cuda_device_is_the_gpu_listing_our_pid(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller does not pass the device and CUDA is up: current_device() (0) would be wrong for cuda:1.
    cuda = SimpleNamespace(current_device=lambda: 0, memory_reserved=lambda index: 0,
                           get_device_properties=lambda index: SimpleNamespace(uuid=""))
    monkeypatch.setattr(process_stats, "_torch_cuda", lambda: cuda)
    gpus = by_index(process_stats.read_process_stats().gpus)
    assert gpus[1].engine_device and not gpus[0].engine_device
    assert gpus[1].memory_kvops_bytes == 60 * GiB


def test_pid_not_listed_falls_back_to_torch_reserved(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml.processes[1] = [SimpleNamespace(pid=OTHER_PID + 1, usedGpuMemory=60 * GiB)]  # a container's host pid
    cuda = SimpleNamespace(current_device=lambda: 1, memory_reserved=lambda index: {1: 50 * GiB}[index],
                           get_device_properties=lambda index: SimpleNamespace(uuid=""))
    monkeypatch.setattr(process_stats, "_torch_cuda", lambda: cuda)
    ours = by_index(process_stats.read_process_stats(device="cuda:1").gpus)[1]
    assert ours.engine_device
    assert (ours.memory_kvops_bytes, ours.memory_others_bytes, ours.memory_kvops_source) == (50 * GiB, 30 * GiB,
                                                                                          "torch")


def test_no_per_process_facts_leaves_the_split_unknown(nvml: FakeNvml) -> None:
    nvml.processes[1] = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=None),
                         SimpleNamespace(pid=os.getpid(), usedGpuMemory=process_stats.NVML_VALUE_NOT_AVAILABLE)]
    ours = by_index(process_stats.read_process_stats(device="cuda:1").gpus)[1]
    assert ours.engine_device and ours.memory_used_bytes == 80 * GiB
    assert ours.memory_kvops_bytes is None and ours.memory_others_bytes is None and ours.memory_kvops_source == ""
    nvml.lists_error = NVMLError("Not Supported")
    gpus = by_index(process_stats.read_process_stats(device="cuda:1").gpus)
    assert gpus[0].memory_kvops_bytes is None and gpus[1].memory_kvops_bytes is None


def test_utilization_not_supported_is_unknown_not_zero(nvml: FakeNvml) -> None:
    nvml.utilization_error = NVMLError("Not Supported")
    stats = process_stats.read_process_stats(device="cuda:1")
    assert stats.gpu_status == "ok"
    assert not by_index(stats.gpus)[1].utilization_known
    _, samples = scrape_engine(snapshot(process=stats.model_dump()))
    assert "kvops_gpu_utilization_ratio" not in samples and "kvops_gpu_memory_used_bytes" in samples


@pytest.mark.parametrize(("breaks", "status"), [
    (lambda f: setattr(f, "init_error", NVMLError("Driver Not Loaded")), "NVML unavailable: Driver Not Loaded"),
    (lambda f: setattr(f, "memory_error", NVMLError("GPU is lost")), "NVML error: GPU is lost"),
    (lambda f: setattr(f, "memory_error", RuntimeError()), "NVML error: RuntimeError"),
    (lambda f: setattr(f, "nvmlDeviceGetCount", lambda: 0), "no GPU: NVML sees no device"),
])
def test_nvml_errors_become_the_status(nvml: FakeNvml, breaks: Callable[[FakeNvml], None], status: str) -> None:
    breaks(nvml)
    stats = process_stats.read_process_stats(device="cuda:0")
    assert (stats.gpus, stats.gpu_status) == ([], status)


def test_a_failed_read_recovers_and_a_failed_init_is_not_retried(nvml: FakeNvml) -> None:
    nvml.memory_error = NVMLError("Unknown Error")
    assert process_stats.read_process_stats(device="cuda:1").gpu_status == "NVML error: Unknown Error"
    nvml.memory_error = None
    assert process_stats.read_process_stats(device="cuda:1").gpu_status == "ok"
    nvml.init_error = NVMLError("Driver Not Loaded")
    fresh = process_stats.Nvml()
    assert fresh.read("cuda:0") == ([], "NVML unavailable: Driver Not Loaded")
    assert fresh.read("cuda:0") == ([], "NVML unavailable: Driver Not Loaded")
    assert nvml.calls["init"] == 2  # the first fixture read, and `fresh` once


def test_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setattr(process_stats, "_nvml", process_stats.Nvml())
    stats = process_stats.read_process_stats(device="cuda:0")
    assert stats.gpus == [] and stats.gpu_status.startswith("NVML unavailable: nvidia-ml-py is not installed")


def test_a_cpu_engine_reads_no_gpu_and_says_why(nvml: FakeNvml) -> None:
    stats = process_stats.read_process_stats(device="cpu")
    assert (stats.gpus, stats.gpu_status) == ([], "no GPU: the engine runs on cpu")
    stats = process_stats.read_process_stats()  # the device inferred: torch has not started CUDA
    assert (stats.gpus, stats.gpu_status) == ([], "no GPU: the engine runs on cpu")
    assert process_stats.read_process_stats(include_gpu=False).gpu_status == "not read"
    assert "init" not in nvml.calls  # NVML is not even loaded for a CPU engine


def test_the_real_module_on_this_machine_never_raises() -> None:
    # Whatever this machine has (here: nvidia-ml-py without a driver), a status comes back, not an exception.
    stats = process_stats.Nvml().read("cuda:0")
    assert stats[1] == "ok" or stats == ([], stats[1])


def test_older_snapshots_without_the_new_fields_still_parse() -> None:
    old = {"cpu_percent": 1.0, "rss_bytes": 1, "num_threads": 1, "gpu_status": "ok",
           "gpus": [{"index": 0, "name": "NVIDIA A100", "memory_used_bytes": 30 * GiB,
                     "memory_total_bytes": 80 * GiB, "utilization_percent": 50.0}]}
    process = ProcessStats.model_validate(old)
    [gpu] = process.gpus
    assert gpu.free_bytes == 50 * GiB and gpu.memory_kvops_bytes is None and gpu.utilization_known
    assert process.engine_gpus() == [gpu]  # none flagged: every listed GPU is taken


# ----------------------------------------------------------------- /metrics


def two_gpu_snapshot(nvml: FakeNvml) -> Snapshot:
    process = process_stats.read_process_stats(device="cuda:1")
    return snapshot(engine={"device": "cuda:1"}, process=process.model_dump())


def scrape_engine(snap: Snapshot) -> tuple[str, dict[str, list[Any]]]:
    text = EngineMetrics(lambda: snap).render()[0].decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return text, samples


def one(samples: dict[str, list[Any]], metric: str, /, **labels: str) -> float:
    [value] = [s.value for s in samples[metric] if all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def documented() -> set[str]:
    return set(re.findall(r"^\|\s*`(kvops_[a-z0-9_]+)`", DOCS.read_text(), re.M))


def promtool(text: str) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not on PATH")
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_engine_metrics_per_gpu(nvml: FakeNvml) -> None:
    text, samples = scrape_engine(two_gpu_snapshot(nvml))
    assert one(samples, "kvops_gpu_status_info", status="ok") == 1
    assert one(samples, "kvops_gpu_engine_device", gpu="1", name="NVIDIA H200") == 1
    assert one(samples, "kvops_gpu_engine_device", gpu="0") == 0
    assert one(samples, "kvops_gpu_memory_total_bytes", gpu="1") == 141 * GiB
    assert one(samples, "kvops_gpu_memory_used_bytes", gpu="1") == 80 * GiB
    assert one(samples, "kvops_gpu_memory_free_bytes", gpu="1") == 61 * GiB
    assert one(samples, "kvops_gpu_memory_used_by_kvops_bytes", gpu="1") == 60 * GiB
    assert one(samples, "kvops_gpu_memory_used_by_others_bytes", gpu="1") == 20 * GiB
    assert one(samples, "kvops_gpu_utilization_ratio", gpu="1") == pytest.approx(0.37)
    gpu_names = {name for name in samples if name.startswith("kvops_gpu_")}
    assert gpu_names <= documented()
    promtool(text)


def test_engine_metrics_on_cpu_have_only_the_reason(nvml: FakeNvml) -> None:
    process = process_stats.read_process_stats(device="cpu")
    _, samples = scrape_engine(snapshot(process=process.model_dump()))
    assert [name for name in samples if name.startswith("kvops_gpu_")] == ["kvops_gpu_status_info"]
    assert one(samples, "kvops_gpu_status_info", status="no GPU: the engine runs on cpu") == 1


class _Families(Collector):
    def __init__(self, families: Callable[[], Iterable[Any]]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        yield from self.families()


def supervisor_text(engines: dict[str, Snapshot]) -> str:
    states = [SimpleNamespace(name=name, history=SimpleNamespace(latest=snap, is_up=True))
              for name, snap in engines.items()]
    registry = CollectorRegistry()
    registry.register(_Families(lambda: exporter.snapshot_families(states)))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_supervisor_republishes_the_engine_gpu_per_engine(nvml: FakeNvml) -> None:
    cpu = snapshot(process={"gpu_status": "no GPU: the engine runs on cpu"})
    vllm = snapshot(source="vllm", unknown=["process.gpus"], process={"gpu_status": "not reported by vllm"})
    text = supervisor_text({"big": two_gpu_snapshot(nvml), "small": cpu, "theirs": vllm})
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    status = {(s.labels["engine"], s.labels["status"]) for s in samples["kvops_engine_gpu_status_info"]}
    assert status == {("big", "ok"), ("small", "no GPU: the engine runs on cpu"), ("theirs", "not reported by vllm")}
    for name, expected in [("kvops_engine_gpu_memory_total_bytes", 141 * GiB),
                           ("kvops_engine_gpu_memory_used_bytes", 80 * GiB),
                           ("kvops_engine_gpu_memory_free_bytes", 61 * GiB),
                           ("kvops_engine_gpu_memory_used_by_kvops_bytes", 60 * GiB),
                           ("kvops_engine_gpu_memory_used_by_others_bytes", 20 * GiB),
                           ("kvops_engine_gpu_utilization_ratio", 0.37)]:
        # only the engine's own GPU (1), only for the engine that has one
        assert [(s.labels, s.value) for s in samples[name]] == [
            ({"engine": "big", "kind": "kvops", "gpu": "1", "name": "NVIDIA H200"}, pytest.approx(expected))], name
    assert {name for name in samples if "_gpu_" in name} <= documented()
    promtool(text)


# ----------------------------------------------------------------- doctor and top


def test_doctor_names_device_memory_split_and_utilization(nvml: FakeNvml) -> None:
    check = engine_device(two_gpu_snapshot(nvml))
    assert check.status is Status.OK
    assert check.evidence == ("cuda:1, float32; GPU 1 NVIDIA H200, 141.0 GiB: kvops 60.0, others 20.0, "
                              "free 61.0 GiB; 37% busy")
    assert check.detail == ["GPU 0 NVIDIA H200, 141.0 GiB: kvops 0.0, others 30.0, free 111.0 GiB; 5% busy"]


def test_doctor_gives_the_reason_instead_of_zeros() -> None:
    cpu = engine_device(snapshot(process={"gpu_status": "no GPU: the engine runs on cpu"}))
    assert cpu.status is Status.INFO and cpu.evidence == "cpu, float32; GPU: no GPU: the engine runs on cpu"
    broken = engine_device(snapshot(engine={"device": "cuda:0"},
                                    process={"gpu_status": "NVML unavailable: Driver Not Loaded"}))
    assert broken.status is Status.WARN and "GPU: NVML unavailable: Driver Not Loaded" in broken.evidence
    assert "nvidia-ml-py" in broken.remedy
    vllm = engine_device(snapshot(source="vllm", unknown=["process.gpus"], engine={"device": "cuda"},
                                  process={"gpu_status": "not reported by vllm"}))
    assert vllm.status is Status.INFO and vllm.evidence.endswith("GPU: not reported by vllm")
    unknown = snapshot(engine={"device": "cuda:0"}, process={"gpu_status": "ok", "gpus": [
        {"index": 0, "name": "NVIDIA A100", "memory_used_bytes": 30 * GiB, "memory_total_bytes": 80 * GiB,
         "utilization_percent": 0.0, "utilization_known": False}]})
    assert engine_device(unknown).evidence == ("cuda:0, float32; GPU 0 NVIDIA A100, 80.0 GiB: used 30.0 (kvops's "
                                               "share not read), free 50.0 GiB; utilization not reported")


def test_top_shows_the_gpu_on_one_line(nvml: FakeNvml) -> None:
    process = two_gpu_snapshot(nvml).process
    line = gpu_compact(process)
    assert line == "gpu1 37% kvops 60G other 20G free 61G"
    assert len(line) <= 38 and "\n" not in line  # the engine info box's width at 160 columns
    assert gpu_summary(process) == ("gpu 1 NVIDIA H200: 37% busy, memory 141.0 GiB: kvops 60.0, others 20.0, "
                                    "free 61.0")
    cpu = ProcessStats(cpu_percent=0, rss_bytes=0, num_threads=1, gpu_status="NVML error: [unknown] error")
    # the info box renders markup: a status is shown as it is, not taken for a tag
    assert Text.from_markup(gpu_compact(cpu)).plain == "gpu: NVML error: [unknown] error"
    assert gpu_summary(cpu) == "gpu: NVML error: [unknown] error"
