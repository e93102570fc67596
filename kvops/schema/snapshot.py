"""The snapshot: one versioned schema for everything an engine reports.

Defined once here and used by the engine (`/stats`), the supervisor, `kvops top` and
`kvops doctor`. Bump SCHEMA_VERSION on any incompatible change.
"""

from __future__ import annotations

import functools
import itertools
import re

from pydantic import BaseModel, Field

from kvops.schema.gateway import GatewayView
from kvops.schema.histogram import (  # noqa: F401  (re-exported: the snapshot's readers import them from here)
    HISTOGRAM_PERCENTILES,
    Histogram,
    bucket_quantile,
    histogram_since,
    percentile_fields,
)
from kvops.schema.kv_events import BlockResidency, KvEventStats

SCHEMA_VERSION = 1

# One character per block state in the compact block map (see `encode_block_map`).
BLOCK_STATE_CODES = {
    "free": ".",
    "filling": "f",
    "full": "F",
    "cached": "c",
    "pending_free": "p",
    "swapped": "s",
}


def encode_block_map(codes: str) -> str:
    """Run-length encode a per-block state string: '....FFc' -> '4.2F1c'. 100k blocks in a few KB."""
    return "".join(f"{len(m.group(0))}{m.group(1)}" for m in re.finditer(r"(.)\1*", codes))


def decode_block_map(encoded: str) -> str:
    return "".join(char * int(count) for count, char in re.findall(r"(\d+)(\D)", encoded))


# The owner map gives each tenant one letter, in order of first appearance; "." is a block nobody
# owns (free) and OTHER_OWNER_CODE stands for every tenant past the 52nd.
OWNER_CODES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
NO_OWNER_CODE = "."
OTHER_OWNER_CODE = "+"


def encode_owner_map(owners: list[str | None]) -> tuple[str, list[str]]:
    """Per-block owning tenants (None: no owner) as (encode_block_map of one letter per block,
    the tenants in letter order)."""
    letters: dict[str, str] = {}
    runs = []
    for owner, run in itertools.groupby(owners):  # a tenant's blocks come in runs: a lookup per run, not per block
        if owner is None:
            code = NO_OWNER_CODE
        elif (code := letters.get(owner)) is None:
            code = OWNER_CODES[len(letters)] if len(letters) < len(OWNER_CODES) else OTHER_OWNER_CODE
            if code != OTHER_OWNER_CODE:
                letters[owner] = code
        runs.append(code * len(list(run)))
    return encode_block_map("".join(runs)), list(letters)


# /stats response headers (kvops/engine/serving/stats_routes.py writes them; the supervisor's client reads them)
SNAPSHOT_SOURCE_HEADER = "X-Kvops-Snapshot"  # "cached": kept fresh by the step loop; "built": for this request
STEPS_KEPT_HEADER = "X-Kvops-Steps-Kept"  # on /stats?steps_after=T: how many recent steps the engine keeps

class EngineInfo(BaseModel):
    model: str
    engine_version: str
    pid: int
    started_at: float  # unix seconds
    device: str
    dtype: str
    kv_cache_dtype: str  # the model dtype name when stored unquantized, else int8 | fp8 | int4
    kv_cache_dtype_skip_layers: list[int] = Field(default_factory=list)  # layers kept in the model dtype
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    bytes_per_token: int  # K and V of one token, all layers, quantization scales included
    host_kv_cache_bytes: int = 0
    enable_prefix_caching: bool
    eviction_policy: str
    compile: str = "off"  # the compiled step: built (at this start), cached (an earlier start's build) or off
    compile_s: float = 0.0  # seconds this start spent building or loading it (or finding why not)


class BlockStats(BaseModel):
    counts: dict[str, int]  # state name -> blocks; the states of BLOCK_STATE_CODES ("swapped": host blocks)
    usage: float  # fraction of blocks holding live sequences' K/V (filling + full)
    state_map: str  # encode_block_map of one code per block, block id order
    owner_map: str = ""  # encode_owner_map: the tenant owning each block, block id order
    owners: list[str] = Field(default_factory=list)  # owner_map's tenants: "a" is owners[0], "b" owners[1]...
    allocated_slots: int  # slots in blocks held by live sequences
    used_slots: int  # of those, slots holding a computed token


class PrefixCacheStats(BaseModel):
    queries_total: int  # prompt tokens looked up (first admission only)
    hits_total: int  # of those, tokens served from cache
    hit_rate: float
    window_s: float
    window_queries: int
    window_hits: int
    window_hit_rate: float
    evictions_total: int
    normalization: str = "off"  # prompt normalization mode: off | shadow | on
    shadow_queries_total: int = 0  # shadow mode: prompt tokens looked up in the normalized model cache
    shadow_hits_total: int = 0  # ... and the tokens that would have hit with normalization on
    shadow_hit_rate: float = 0.0
    potential_queries_total: int = 0  # prefix caching off: prompt tokens looked up in a shadow cache
    potential_hits_total: int = 0  # ... and the tokens caching would have served
    potential_hit_rate: float = 0.0


class RequestStats(BaseModel):
    running: int
    waiting: int
    finished_total: int  # requests that ended normally (stop, length); aborted ones are counted apart
    aborted_total: int
    preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Median over live requests (running, swapped, waiting) of prompt + max_tokens, capped at
    # max_model_len: how long they may grow, which sizing concurrency needs before any has finished.
    live_requested_len_p50: int | None = None
    # Requests that got a first token and never ended, on a server that does not count a client's hang-up as an
    # abort (vLLM 0.32: its time-to-first-token count minus its end-to-end count, less the requests running);
    # None where the server counts hang-ups itself (kvops's engine) or its counters do not allow the estimate.
    abandoned_total: int | None = None
    # Latency of generated tokens, cumulative (the difference of two snapshots gives the mean over
    # the interval): time to first token from arrival, and between consecutive tokens of a request.
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0
    itl_seconds_sum: float = 0.0
    itl_count: int = 0


class RankStats(BaseModel):
    """One rank of a server that reports per rank (vLLM's `engine` label under data parallelism, SGLang's
    `tp_rank` / `dp_rank` / `pp_rank`): the snapshot's totals add the ranks up; doctor shows them when they differ."""
    labels: dict[str, str]  # the labels that tell this rank from the others, e.g. {"dp_rank": "1"}
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None


class StepSample(BaseModel):
    t: float  # unix seconds at the end of the step
    duration_s: float
    num_seqs: int
    num_tokens: int
    decode_only: bool
    max_context_len: int


class SwapWindow(BaseModel):
    """Swap activity over the last `window_s` seconds."""

    window_s: float = 60.0
    swap_out: int = 0  # blocks copied device -> host
    swap_in: int = 0  # blocks copied host -> device
    allocations: int = 0  # device blocks handed out (new sequences, growth, swap-in)
    swap_out_per_s: float = 0.0
    swap_in_per_s: float = 0.0
    swap_rate: float = 0.0  # swap_out / allocations: the share of block allocations that pushed a block out


class SwapStats(BaseModel):
    preemption_mode: str = "recompute"  # swap | recompute
    host_blocks: int = 0  # size of the host pool (--swap-space)
    swapped_blocks: int = 0  # host blocks holding swapped-out K/V
    swapped_seqs: int = 0  # sequences waiting in the host pool
    swap_out_total: int = 0  # blocks copied device -> host
    swap_in_total: int = 0  # blocks copied host -> device
    swap_in_reused_total: int = 0  # blocks restored from the device prefix cache instead, without a copy
    swap_preemptions_total: int = 0  # preemptions that swapped a sequence out
    swap_fallbacks_total: int = 0  # preemptions that wanted to swap but found the host pool full: recomputed
    window: SwapWindow = Field(default_factory=SwapWindow)
    host_state_map: str = ""  # encode_block_map of the host pool (free "." or swapped "s")


class TenantStats(BaseModel):
    requests_total: int = 0
    prompt_tokens_total: int = 0
    hit_tokens_total: int = 0
    hit_rate: float = 0.0
    blocks_held: int = 0  # distinct blocks its live sequences reference
    blocks_owned: int = 0  # blocks it allocated that are not free yet (cached ones included): what a quota caps
    quota_blocks: int | None = None
    cache_salt: str = ""  # tenants with equal salts share prefix blocks
    evictions_caused: int = 0
    evictions_suffered: int = 0


class GpuStats(BaseModel):
    """One GPU as NVML sees it. NVML's index is physical: CUDA_VISIBLE_DEVICES renumbers torch's devices, not
    NVML's, so `engine_device` (not the index) says which GPU the engine's tensors live on."""

    index: int
    name: str
    memory_used_bytes: int  # by every process on the GPU (NVML's used)
    memory_total_bytes: int
    utilization_percent: float  # 0 when not `utilization_known`: rules sum this field, so it stays a number
    # Added compatibly (older engines leave them at their defaults): None is "not read", never a made-up 0.
    memory_free_bytes: int | None = None  # NVML's free (older snapshots: total - used)
    memory_kvops_bytes: int | None = None  # held by the engine process itself
    memory_others_bytes: int | None = None  # used - kvops: other processes, and the driver's own
    # Where memory_kvops_bytes came from: "nvml" (the per-process list, matched on the engine's pid), "torch"
    # (torch.cuda.memory_reserved: NVML did not list the pid, e.g. in a container; the CUDA context is not in it).
    memory_kvops_source: str = ""
    utilization_known: bool = True  # False where NVML does not sample it (a MIG slice, some vGPUs)
    engine_device: bool = False  # the GPU the engine runs on (others are listed for context)

    @property
    def free_bytes(self) -> int:
        return self.memory_free_bytes if self.memory_free_bytes is not None else max(
            0, self.memory_total_bytes - self.memory_used_bytes)


GPU_STATUS_OK = "ok"


class ProcessStats(BaseModel):
    cpu_percent: float
    rss_bytes: int
    num_threads: int
    # The engine's torch thread count (--threads) and the CPUs other processes kept busy at its last check
    # (auto only); None from engines that predate them and from scrapes.
    torch_threads: int | None = None
    others_busy_cpus: float | None = None
    gpus: list[GpuStats] = Field(default_factory=list)
    # GPU_STATUS_OK, or why `gpus` is empty: "no GPU: the engine runs on cpu", "NVML unavailable: <reason>",
    # "NVML error: <reason>", "not read" (the snapshot was built without GPU facts).
    gpu_status: str

    def engine_gpus(self) -> list[GpuStats]:
        """The GPUs flagged as the engine's; every listed GPU when none is (older engines, scrapes)."""
        flagged = [gpu for gpu in self.gpus if gpu.engine_device]
        return flagged or list(self.gpus)


class Snapshot(BaseModel):
    schema_version: int = SCHEMA_VERSION
    # Added compatibly (defaults = a kvops engine that reports everything), so schema_version stays 1.
    source: str = "kvops"  # the kind of server it came from: a kind of kvops.kinds
    # Fields the source does not report, as dotted paths ("swap", "tenants", "engine.num_blocks"): they hold
    # neutral values (0, empty) that rules read as "nothing happening", and doctor marks as not checked.
    unknown: list[str] = Field(default_factory=list)
    time: float  # unix seconds
    uptime_s: float
    engine: EngineInfo
    blocks: BlockStats
    prefix_cache: PrefixCacheStats
    requests: RequestStats
    prompt_lengths: Histogram
    # Generated tokens per finished request, where the source reports them (vLLM's
    # request_generation_tokens); None: only the mean is known (generation_tokens_total / finished_total).
    generation_lengths: Histogram | None = None
    # Latency histograms in seconds, cumulative since start, where the source has them: time to first token,
    # and time between consecutive tokens of a request. None: not reported (the sums in `requests` may be).
    ttft: Histogram | None = None
    itl: Histogram | None = None
    ranks: list[RankStats] = Field(default_factory=list)  # empty: one rank, or not reported per rank
    # Snapshot field (dotted path) -> the source's metric names it was read from: doctor -v names them.
    metrics_read: dict[str, list[str]] = Field(default_factory=dict)
    # Values the source reported that cannot be right (a ratio over 100%, ...): metrics problems, not diagnoses.
    data_problems: list[str] = Field(default_factory=list)
    steps: list[StepSample]  # recent engine steps, oldest first (decode latency series)
    swap: SwapStats
    tenants: dict[str, TenantStats]
    process: ProcessStats
    # From the engine's KV cache events (kvops.events), where kvops reads them; None: not read.
    kv_events: KvEventStats | None = None
    # The engine's own sampled block residency histograms (vLLM's --kv-cache-metrics); None: not reported.
    residency: BlockResidency | None = None
    # The `kvops gateway` in front of the engine, where the supervisor reads one; None: none.
    gateway: GatewayView | None = None

    def knows(self, path: str) -> bool:
        """False when `path` (or a field containing it) is among the fields the source does not report."""
        if not self.unknown:
            return True
        gaps = _gaps(tuple(self.unknown))
        if path in gaps:
            return False
        dot = path.find(".")
        while dot != -1:  # a containing field: "blocks" holds "blocks.usage"
            if path[:dot] in gaps:
                return False
            dot = path.find(".", dot + 1)
        return True


@functools.lru_cache(maxsize=256)
def _gaps(unknown: tuple[str, ...]) -> frozenset[str]:
    """A source's unknown fields as a set: rules and adapters ask `knows` thousands of times a poll, and a scraped
    snapshot lists dozens of gaps (a linear scan was a third of a fleet supervisor's reading time)."""
    return frozenset(unknown)
