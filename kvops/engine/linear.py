"""The matmul behind every projection, and the choice of backend that holds while serving.

On x86 CPUs PyTorch's default fp32 `F.linear` goes through MKL. Which of MKL and oneDNN is faster
depends on the processor and the row count: on an AMD EPYC (2 cores, weights streamed from DRAM)
oneDNN was 1.6–1.9× faster at 1–16 rows; on an Intel Xeon with AMX, MKL's matrix-vector path is
1.35–1.6× faster at 1–2 rows (one stream's decode step 69 → 43–47 ms) and oneDNN 1.2–1.4× faster
from 8 rows on (docs/benchmarks.md). So the engine measures both at start, on the model's own weights,
and sends the row counts where `F.linear` wins to it, the rest to oneDNN (operands swapped, see
`_onednn_linear`). `KVOPS_LINEAR=torch|onednn` forces one path.

One measurement used to decide the engine's speed for its whole life, and a transient flipped it: on a
2-vCPU EPYC a start measured while a neighbour process was exiting chose MKL (36.7 against 42.2 ms a
pass) and served one stream at 17 tok/s, the start before 43 tok/s. So the start's measurement is `ROUNDS`
rounds, each backend's order alternating from round to round, and each number the median of the rounds.
A busy spell longer than the measurement still moves the medians (measured here with two CPU burners
through the start: oneDNN 976 against MKL's 50 ms a pass, where it is 37 against 42 quiet), so while
serving `LinearDispatch` measures again (`RECHECK_ROUNDS` rounds, a slice at a time): after a minute, then
at doubling intervals up to an hour while the split holds, and sooner when the steps' own linear time (it
times its calls at the probed row counts: two clock reads a call, ~15 µs a step of ~35 ms) departs from
the measurement by more than `DRIFT`. Either runs in the engine's idle time on a quiet machine, or between
steps when it has had no idle time for `IDLE_WAIT_S` past due (`IDLE_BUSY_WAIT_S` when it had some, none
quiet). A split that differs from the one in use is measured once more before it is used: three rounds in a
noisy moment once timed the compiled matmul at twice its time and sent one row to oneDNN. Every measurement
and every change is logged.

A measurement holds for the torch thread count it was taken at (kvops/engine/threads.py changes it while others
keep a core busy): a step at another count is not drift, and compared with it once made a 1-thread step
beside a busy process look 43% slow and re-measured the backends inside a request (one stream's round 14
instead of 31 tok/s). The dispatch keeps the split of each count it has measured and takes it back up when
the count comes back.

Where the engine runs the compiled step (kvops/engine/compiled.py) in fp32, its matmul is a third backend, measured
in the same interleaved rounds up to `COMPILED_PROBE_ROWS` and watched the same way: a start measured in a busy
spell had left it unused for the engine's life (one stream at 21 instead of 28 tok/s), since only the other
two were measured again.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger("kvops.engine.linear")

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# backend -> ms per pass over the weights at each probed row count (None: that backend is not probed there)
Timings = dict[str, list[float | None]]


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Computed as (W @ x^T)^T: the same values bit for bit, but oneDNN blocks the few-row decode
    # case much better this way round (16 rows × 3072 × 576: 407 µs against 570 µs).
    # The result is a transposed view; callers that need a contiguous layout ask for one.
    out = torch.ops.mkldnn._linear_pointwise(weight, x, None, "none", [], "").t()
    return out if bias is None else out + bias


# Row counts tried; a backend takes a count when it is clearly (5%) faster there: with each number a median of
# interleaved rounds and a new split confirmed by a second measurement, 10% had left 16 rows to oneDNN where the
# compiled matmul's passes took 0.90 of its time and 16 chats ran 7% faster with it (4.40 against 4.72 s for 64
# tokens each, the 2-vCPU EPYC). Above the largest, oneDNN always. F.linear is tried up to PROBE_ROWS[-1] only:
# above, oneDNN won on every machine measured, and F.linear's passes at 8 and 16 rows would be the slowest part of
# the measurement. The compiled matmul is tried up to 16 rows,
# where it still won on the 2-vCPU EPYC (82 against oneDNN's 99 ms a pass).
PROBE_ROWS = (1, 2, 4)
COMPILED_PROBE_ROWS = (1, 2, 4, 8, 16)
_CLEAR_WIN = 0.95
ROUNDS = 5  # a slow spell of one or two rounds does not move a median of five
RECHECK_ROUNDS = 3  # while serving: ~3 s on the 2-vCPU EPYC with the compiled matmul, in slices between steps
# While serving, the backends are measured again RECHECK_AFTER_S after the last measurement, the wait doubling
# up to RECHECK_MAX_S while the split holds (back to the start when it changes); and sooner (but not within
# RECHECK_AFTER_S of the last) when the steps' linear time at a probed row count, the median of WATCH_STEPS
# steps, departs from the measurement by more than DRIFT.
DRIFT = 0.3
WATCH_STEPS = 16
RECHECK_AFTER_S = 60.0
RECHECK_MAX_S = 3600.0
# A scheduled measurement waits up to IDLE_WAIT_S for the engine to be idle on a quiet machine (`idle()`), so no
# request waits behind it (one stream's first request after the schedule came due: 3.2 s instead of 1.3 on the
# 2-vCPU EPYC) and no other process's work is in it; an engine never idle has it between steps after that.
IDLE_WAIT_S = 60.0
# An engine that does get idle time, none of it quiet, waits longer: in a side-by-side run kvops is idle while the
# vLLMs serve, its quiet moments are a second or two before its own requests, and a measurement a minute past due
# went on between the steps of one stream's request (3.2 s instead of 1.4).
IDLE_BUSY_WAIT_S = 600.0
# Quiet enough to measure in: other processes' work below this many CPUs. Stricter than a core taken
# (kvops/engine/threads.py): one ran beside two vLLMs settling after their start, under half a core between readings,
# and timed every backend ~1.5x slow (oneDNN at 16 rows: 70 against 49 ms), which the drift then re-measured
# inside a request.
QUIET_BELOW_CPUS = 0.2


def probe_rows_for(backends: dict[str, Linear] | list[str]) -> tuple[int, ...]:
    return COMPILED_PROBE_ROWS if "compiled" in backends else PROBE_ROWS


@dataclass(frozen=True, slots=True)
class Split:
    """Which backend takes a step of so many rows: the compiled matmul up to `compiled_rows`, F.linear up to
    `torch_rows`, oneDNN above (0: none)."""

    compiled_rows: int = 0
    torch_rows: int = 0

    def backend_for(self, rows: int) -> str:
        if self.compiled_rows and rows <= self.compiled_rows:  # a step that samples nothing has 0 rows
            return "compiled"
        return "torch" if rows <= self.torch_rows else "onednn"

    @property
    def name(self) -> str:
        parts = [f"compiled up to {self.compiled_rows} rows"] if self.compiled_rows else []
        if self.torch_rows > self.compiled_rows:
            parts.append(f"torch up to {self.torch_rows} rows")
        return ", ".join([*parts, "onednn above"]) if parts else "onednn"


def select_linear(device: torch.device, dtype: torch.dtype, weights: list[torch.Tensor] | None = None,
                  compiled: Linear | None = None) -> tuple[str, Linear]:
    """The fastest linear that agrees with F.linear on this device, and its name. `weights`: the model's
    projections, as a decode step reads them, timed with each backend (none given: oneDNN for every row count);
    `compiled`: the compiled step's matmul, a third backend. With the backends measured, the linear is a
    `LinearDispatch` that keeps the choice right while serving."""
    choice = os.environ.get("KVOPS_LINEAR", "auto")
    if choice not in ("auto", "torch", "onednn"):
        raise ValueError(f"KVOPS_LINEAR={choice!r} is not one of auto, torch, onednn")
    if choice == "torch" or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "torch", _torch_linear
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, 64, generator=generator).to(dtype)
        w = torch.randn(32, 64, generator=generator).to(dtype)
        b = torch.randn(32, generator=generator).to(dtype)
        expected = F.linear(x, w, b)
        got = _onednn_linear(x, w, b)
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
            raise ValueError("oneDNN linear disagrees with F.linear")
    except Exception as exc:  # an older PyTorch without the op, or a build without oneDNN
        log.info("oneDNN linear unavailable; using F.linear", reason=str(exc)[:200])
        return "torch", _torch_linear
    if choice == "onednn" or not weights:
        return "onednn", _onednn_linear
    backends = {"torch": _torch_linear, "onednn": _onednn_linear, **({"compiled": compiled} if compiled else {})}
    split, timings = measure_split(weights, backends)
    log.info("linear backends measured", split=split.name, probe_rows=probe_rows_for(backends),
             ms_per_pass=timings, rounds=ROUNDS)
    dispatch = LinearDispatch(weights, backends, timings)
    return dispatch.name, dispatch


# A measurement in slices: each yield is one round at one row count, every backend timed once.
Measuring = Generator[None, None, tuple["Split", Timings]]


def measuring(weights: list[torch.Tensor], backends: dict[str, Linear], rounds: int = ROUNDS,
              probe_rows: tuple[int, ...] | None = None) -> Measuring:
    """Each backend's time for one pass over all `weights` per probed row count (`probe_rows_for(backends)`), in
    ms: the median of `rounds` rounds, the backends interleaved and their order alternating, so that a slow spell
    hits all and moves no median; and the split they give. F.linear is not timed above PROBE_ROWS (None there).
    It yields after each slice (a round at one row count), so that a measurement while serving can run between
    steps a slice at a time."""
    probe_rows = probe_rows or probe_rows_for(backends)
    generator = torch.Generator().manual_seed(0)
    widths = sorted({w.shape[1] for w in weights})
    samples: dict[str, list[list[float]]] = {name: [[] for _ in probe_rows] for name in backends}
    order = list(backends.items())
    inputs = [{k: torch.randn(m, k, generator=generator).to(weights[0].dtype) for k in widths} for m in probe_rows]
    for round_ in range(rounds):
        for i, m in enumerate(probe_rows):
            for name, fn in order if round_ % 2 == 0 else order[::-1]:
                if name == "torch" and m > PROBE_ROWS[-1]:
                    continue
                started = time.perf_counter()
                for w in weights:
                    fn(inputs[i][w.shape[1]], w, None)
                samples[name][i].append((time.perf_counter() - started) * 1000)
            if round_ < rounds - 1 or i < len(probe_rows) - 1:
                yield
    timings: Timings = {name: [round(statistics.median(s), 2) if s else None for s in per_rows]
                        for name, per_rows in samples.items()}
    return split_from(timings, probe_rows), timings


def finish(measurement: Measuring) -> tuple[Split, Timings]:
    """Run a measurement to its end in one go."""
    while True:
        try:
            next(measurement)
        except StopIteration as done:
            return done.value


def measure_split(weights: list[torch.Tensor], backends: dict[str, Linear],
                  rounds: int = ROUNDS) -> tuple[Split, Timings]:
    """The split the backends' timings give, and the timings, in one go (the start's measurement)."""
    return finish(measuring(weights, backends, rounds))


def split_from(timings: Timings, probe_rows: tuple[int, ...] = PROBE_ROWS) -> Split:
    """F.linear against oneDNN, then the compiled matmul (if timed) against whichever of them that gives."""
    torch_rows = torch_rows_from(timings, probe_rows=probe_rows)
    if "compiled" not in timings:
        return Split(0, torch_rows)
    chosen = [t if m <= torch_rows else o for m, t, o in zip(probe_rows, timings["torch"], timings["onednn"],
                                                             strict=True)]
    compiled_rows = torch_rows_from({**timings, "chosen": chosen}, "compiled", "chosen", probe_rows)
    # F.linear's rows within the compiled matmul's are not its: one split, one name, for one routing
    return Split(compiled_rows, torch_rows if torch_rows > compiled_rows else 0)


def torch_rows_from(timings: Timings, fast: str = "torch", base: str = "onednn",
                    probe_rows: tuple[int, ...] = PROBE_ROWS) -> int:
    """The largest of `probe_rows` up to which `fast` is clearly faster than `base` at every count from one row
    up (0: not even at one row; a count where either was not timed ends the run). One threshold, so a win at 4
    rows after a loss at 2 does not count."""
    rows = 0
    for m, fast_ms, base_ms in zip(probe_rows, timings[fast], timings[base], strict=True):
        if fast_ms is None or base_ms is None or fast_ms >= _CLEAR_WIN * base_ms:
            break
        rows = m
    return rows


class LinearDispatch:
    """Each row count to the backend the split gives, measured again while serving when the steps drift from
    the measurement. The model calls it for every projection and `step_done()` after each forward pass; a
    measurement while serving runs there, one slice (a round at one row count) between two steps, so no step
    waits for more than a slice (~0.3 s at 16 rows on the 2-vCPU EPYC) where the whole would take ~3 s."""

    def __init__(self, weights: list[torch.Tensor], backends: dict[str, Linear], timings: Timings,
                 measure: Callable[[list[torch.Tensor]], Measuring] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 threads: Callable[[], int] = torch.get_num_threads) -> None:
        self.weights = weights
        self.backends = backends
        self.probe_rows = probe_rows_for(backends)
        self.timings = timings
        self.split = split_from(timings, self.probe_rows)
        self._threads = threads
        self.threads = threads()  # the count `timings` were measured at
        self._by_threads: dict[int, tuple[Split, Timings]] = {self.threads: (self.split, timings)}
        self._stepped_at = self.threads  # the count the watched steps ran at
        self.rechecks = 0
        self.changes = 0
        self.abandoned = 0  # measurements dropped: other processes got busy in idle time, or the thread count changed
        self._measure = measure or (lambda w: measuring(w, self.backends, RECHECK_ROUNDS))
        self._measuring: Measuring | None = None  # a measurement under way, and why it was started
        self._why = ""
        self._idle_only = False  # the measurement under way started in idle time: its slices wait for idle time
        self._idle_while_due = False  # the engine had idle time since the measurement came due
        self._due_why: str | None = None  # why a measurement is due before its schedule (drift, a confirmation)
        self._pending: Split | None = None  # a new split measured once, to be measured again before it is used
        self._clock = clock
        self._recheck_after_s = RECHECK_AFTER_S
        self._last_check = clock()
        self._next_check = self._last_check + RECHECK_AFTER_S
        self._spent = 0.0  # seconds in linear calls this step, while every call had the same row count
        self._step_rows = 0  # that row count; 0: none yet; -1: mixed (a prefill step's head, say): not timed
        self._watched = {m: deque[float](maxlen=WATCH_STEPS) for m in self.probe_rows}

    @property
    def name(self) -> str:
        return self.split.name

    def backend_for(self, rows: int) -> str:
        """The backend that takes `rows` rows now: compiled, torch or onednn."""
        return self.split.backend_for(rows)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        started = time.perf_counter()
        out = self.backends[self.backend_for(m)](x, weight, bias)
        self.account(m, time.perf_counter() - started)
        return out

    def account(self, rows: int, seconds: float) -> None:
        """`seconds` of matmuls at `rows` rows this step, timed here or by the compiled step (compiled.py)."""
        if rows > self.probe_rows[-1]:
            self._step_rows = -1
            return
        self._spent += seconds
        self._step_rows = rows if self._step_rows in (0, rows) else -1

    def step_done(self) -> None:
        """One forward pass ended: its linear time joins the watch of its row count, and the backends are
        measured again when it is time, or when the watch departs from the measurement."""
        m, spent = self._step_rows, self._spent
        self._step_rows, self._spent = 0, 0.0
        threads = self._threads()
        if threads != self._stepped_at:
            self._threads_changed(threads)
        now = self._clock()
        if self._measuring is not None:
            # One started in idle time pauses while requests run (carried on between a request's steps it cost one
            # stream 1.6 s of 3.3), unless the engine has had no quiet idle time for long past due.
            if not self._idle_only or now >= self._next_check + self._between_steps_after():
                self._idle_only = False
                self._advance()
            return
        if now >= self._next_check + self._between_steps_after():
            self.recheck(self._reason(now, "not idle since"))
            return
        if now >= self._next_check:  # due already: no need to watch for drift
            return
        watched = self._watched.get(m)
        if watched is None or threads != self.threads:  # measured at another count: no prediction for this one
            return
        watched.append(spent * 1000)
        if len(watched) < WATCH_STEPS or now < self._last_check + RECHECK_AFTER_S:
            return
        backend = self.backend_for(m)
        predicted = self.timings[backend][self.probe_rows.index(m)]
        observed = statistics.median(watched)
        if predicted and abs(observed / predicted - 1) > DRIFT:
            self._make_due(f"{m}-row steps took {observed:.1f} ms in linears, {predicted:.1f} ms measured ({backend})")

    def _between_steps_after(self) -> float:
        """How long past due a measurement waits for quiet idle time before it runs between steps."""
        return IDLE_BUSY_WAIT_S if self._idle_while_due else IDLE_WAIT_S

    def _make_due(self, why: str) -> None:
        """Due now, before the schedule: measured in idle time on a quiet machine like a scheduled one (a drift
        measured between steps at once cost a request ~3 s), between steps IDLE_WAIT_S later if never idle."""
        self._next_check, self._due_why = min(self._next_check, self._clock()), why

    def _reason(self, now: float, where: str) -> str:
        return f"{self._due_why or 'scheduled'}, {now - self._last_check:.0f} s after the last measurement, {where}"

    def wants_idle(self) -> bool:
        """Whether `idle()` has anything to do: a measurement under way, or one due."""
        return self._measuring is not None or self._clock() >= self._next_check

    def idle(self, quiet: bool) -> bool:
        """The engine has no request to run: one slice of a measurement under way, or the first of a scheduled
        one, while the machine is `quiet` (other processes kept no core busy since the last call: a measurement
        beside them would time their work, as one did beside a vLLM serving and chose F.linear at one row, where
        quiet the compiled matmul is 2x faster). A measurement under way when others get busy is dropped; a due
        one starts again when it is quiet. True when a slice ran: the caller checks for requests, then calls
        again."""
        if self._measuring is not None:
            self._idle_while_due = True
            if not quiet:
                self._abandon("other processes got busy")
                return False
            self._advance()
            return True
        now = self._clock()
        if now < self._next_check:
            return False
        self._idle_while_due = True
        if not quiet:
            return False
        self.recheck(self._reason(now, "while idle"))
        self._idle_only = self._measuring is not None
        return True

    def _threads_changed(self, threads: int) -> None:
        """The steps run at a new torch thread count: its own split where one was measured at it, and a watch
        that starts afresh."""
        self._stepped_at = threads
        self._pending = None  # a confirmation is of the same count
        for watched in self._watched.values():
            watched.clear()
        if self._measuring is not None:  # its slices would mix two counts
            self._abandon("the torch thread count changed")
        known = self._by_threads.get(threads)
        if known is None or threads == self.threads:
            return
        before = self.split
        (self.split, self.timings), self.threads = known, threads
        if self.split != before:
            self.changes += 1
            log.info("linear backend changed with the thread count", threads=threads, before=before.name,
                     after=self.name, ms_per_pass=self.timings)

    def recheck(self, why: str) -> None:
        """Start measuring the backends again (its first slice now, the rest after the next steps); the split
        they give is kept and logged, with the reason, when the measurement ends."""
        self._measuring, self._why, self._idle_only = self._measure(self.weights), why, False
        self._advance()

    def _abandon(self, cause: str) -> None:
        assert self._measuring is not None
        self._measuring.close()
        self._measuring = None
        self.abandoned += 1
        log.info(f"linear backends measurement dropped: {cause}", reason=self._why)

    def _advance(self) -> None:
        assert self._measuring is not None
        try:
            next(self._measuring)
        except StopIteration as done:
            self._measuring = None
            self._measured(*done.value)

    def _measured(self, split: Split, timings: Timings) -> None:
        self.rechecks += 1
        self._due_why, self._idle_while_due = None, False
        self._last_check = self._clock()
        for watched in self._watched.values():
            watched.clear()
        if split != self.split and split != self._pending:
            # One 3-round measurement in a noisy moment flipped the split (the compiled matmul timed at 36 for 18 ms
            # a pass at one row, and oneDNN chosen there): a new split is used once a second measurement agrees.
            self._pending = split
            self._make_due(f"confirming {split.name}")
            log.info("linear backends measured again: a new split, to be confirmed", reason=self._why,
                     split=self.name, new_split=split.name, ms_per_pass=timings, threads=self._threads())
            return
        self._pending = None
        before, before_timings = self.split, self.timings
        self.split, self.timings, self.threads = split, timings, self._threads()
        self._by_threads[self.threads] = (split, timings)
        changed = self.split != before
        self.changes += changed
        # A split confirmed: look again later; a changed one: the machine is changing, look again soon.
        self._recheck_after_s = RECHECK_AFTER_S if changed else min(2 * self._recheck_after_s, RECHECK_MAX_S)
        self._next_check = self._last_check + self._recheck_after_s
        log.info("linear backends measured again", reason=self._why, split=self.name, ms_per_pass=self.timings,
                 threads=self.threads, before_ms_per_pass=before_timings, next_check_s=self._recheck_after_s)
        if changed:
            log.warning("linear backend changed", before=before.name, after=self.name, reason=self._why)
