"""What the engine counts while it runs: the raw material of the snapshot (`snapshot_builder.py` builds it)."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvops.schema.snapshot import StepSample

PROMPT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# 1 ms to 5 min: fine steps where decode and first-token latencies live, coarse ones for long requests.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
)


@dataclass
class TenantCounters:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    hit_tokens_total: int = 0


class EngineStats:
    def __init__(self, window_s: float = 60.0, max_steps: int = 512, max_prompt_samples: int = 2048,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self._swap_totals = (0, 0, 0)  # swap-out blocks, swap-in blocks, block allocations, as last seen
        self._swap_window: deque[tuple[float, int, int, int]] = deque()  # (time, the three deltas)
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self._prefix_window: deque[tuple[float, int, int]] = deque()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0
        self.aborted_total = 0
        self.prompt_bucket_counts = [0] * (len(PROMPT_LENGTH_BUCKETS) + 1)  # the last counts lengths above every bound
        self.prompt_length_sum = 0
        self.prompt_length_count = 0
        self._recent_prompt_lengths: deque[int] = deque(maxlen=max_prompt_samples)
        self.steps: deque[StepSample] = deque(maxlen=max_steps)
        self.tenants: dict[str, TenantCounters] = {}
        self.ttft_seconds_sum = 0.0
        self.ttft_count = 0
        self.itl_seconds_sum = 0.0
        self.itl_count = 0
        self.ttft_bucket_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.itl_bucket_counts = [0] * (len(LATENCY_BUCKETS) + 1)

    def on_admit(self, tenant: str, prompt_len: int, hit_tokens: int) -> None:
        """A request's first admission: count its prefix-cache lookup and its prompt length."""
        now = self.clock()
        self.prefix_queries_total += prompt_len
        self.prefix_hits_total += hit_tokens
        self._prefix_window.append((now, prompt_len, hit_tokens))
        self.prompt_tokens_total += prompt_len
        counters = self.tenants.setdefault(tenant, TenantCounters())
        counters.requests_total += 1
        counters.prompt_tokens_total += prompt_len
        counters.hit_tokens_total += hit_tokens
        self.prompt_bucket_counts[bisect.bisect_left(PROMPT_LENGTH_BUCKETS, prompt_len)] += 1
        self.prompt_length_sum += prompt_len
        self.prompt_length_count += 1
        self._recent_prompt_lengths.append(prompt_len)

    def on_first_token(self, seconds: float) -> None:
        self.ttft_seconds_sum += seconds
        self.ttft_count += 1
        self.ttft_bucket_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def on_next_token(self, seconds: float) -> None:
        self.itl_seconds_sum += seconds
        self.itl_count += 1
        self.itl_bucket_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def on_step(self, sample: StepSample, generated_tokens: int) -> None:
        self.steps.append(sample)
        self.generation_tokens_total += generated_tokens

    def prefix_window_counts(self) -> tuple[int, int]:
        """(prompt tokens queried, tokens hit) over the last `window_s` seconds."""
        cutoff = self.clock() - self.window_s
        while self._prefix_window and self._prefix_window[0][0] < cutoff:
            self._prefix_window.popleft()
        return sum(q for _, q, _ in self._prefix_window), sum(h for _, _, h in self._prefix_window)

    def on_swap_counters(self, swap_out_total: int, swap_in_total: int, allocations_total: int) -> None:
        """Record the block manager's cumulative swap and allocation counters (after each step)."""
        totals = (swap_out_total, swap_in_total, allocations_total)
        deltas = [now - before for now, before in zip(totals, self._swap_totals, strict=True)]
        self._swap_totals = totals
        if any(deltas):
            self._swap_window.append((self.clock(), *deltas))

    def swap_window_counts(self) -> tuple[int, int, int, float]:
        """(blocks swapped out, blocks swapped in, block allocations) over the last `window_s` seconds,
        and the seconds that window really spans (less than `window_s` just after start)."""
        now = self.clock()
        while self._swap_window and self._swap_window[0][0] < now - self.window_s:
            self._swap_window.popleft()
        out = sum(d[1] for d in self._swap_window)
        into = sum(d[2] for d in self._swap_window)
        allocations = sum(d[3] for d in self._swap_window)
        return out, into, allocations, max(min(self.window_s, now - self.started), 1e-9)

    def recent_prompt_lengths(self) -> list[int]:
        """The last `max_prompt_samples` prompt lengths, oldest first (the histogram's buckets are too coarse
        for anything that depends on lengths modulo a block size)."""
        return list(self._recent_prompt_lengths)
