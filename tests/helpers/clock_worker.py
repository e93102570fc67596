"""Two pytest workers (`pytest -n 2`, pytest-xdist) where the tests that judge something on the wall clock keep the
machine to themselves.

A test marked `clock` measures or judges over real time: a scenario's judged windows, a fix verified on live
traffic, a real vLLM at its measured speed. Those run one after another, in collection order, on the clock worker
(gw0), at normal priority, as they would alone. Every other test runs on the background worker: pinned to the last
CPU, at the lowest priority (nice 19) and with one torch thread, so that it takes what the clock tests leave idle (a
scenario waiting out its window, a vLLM computing on one core) and gives a core back the moment they ask for it. The
clock worker takes background tests too once its clock tests are done.

Alone, the tests that judge nothing are CPU-bound and the clock tests leave most of a core idle; two workers at equal
priority would each run at half speed and move the clock tests' verdicts.

Nice alone is not enough on Linux: autogroup schedules each session as one group, and the engines, vLLMs and daemons
the clock tests start run in sessions of their own (kvops.processes.start_in_own_session), so a nice-19 worker in
pytest's session got an equal share against them (a 2-thread matmul beside such a burner ran 10x slower). The
background worker therefore leads a session of its own whose group is at nice 19, and the children it starts in new
sessions keep that level. Measured: docs/benchmarks.md, "The test suite's time".

Even so the real-vLLM tests ran 1.5-4x slower beside the background (a vLLM start 57 -> 84 s, the hang-up test
40 -> 112 s, and it failed once): a nice level is a share of the CPU, and vLLM's processes, which pass each token
between them and wake up many times a step, waited out the background's slices. Where the kernel lets it (root, a
cpu cgroup controller), the background worker therefore moves into a cpu cgroup marked idle (`cpu.idle`, the
SCHED_IDLE policy for a whole group, which no autogroup can escape): any other task that wakes takes the CPU from it
at once, and beside it the vLLM tests ran as alone (a vLLM start 46 against 45 s, the block-size fix 76 against 76).
Without one, the real-vLLM tests run with the machine to themselves: while the clock worker runs a stretch of tests
marked `vllm`, the background worker finishes the test it is in and starts no other (MachineLock).
Without xdist (`pytest` with no `-n`) every test runs in the one process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

CLOCK = "clock"  # the xdist group, and the marker, of the tests that judge on the wall clock
# The real-vLLM tests too: they share the session's one vLLM (tests/conftest.py), which lives in one worker, and a
# vLLM start takes both CPUs for most of a minute.
CLOCK_MARKERS = (CLOCK, "vllm")
CLOCK_WORKER = "gw0"
BACKGROUND_NICE = 19
ALONE_MARKERS = ("vllm",)  # the clock tests that run with the background worker paused, unless it is idle
# The cpu cgroup the background worker moves into where it can (cpu.idle = 1), under the cpu controller's root.
IDLE_CGROUP = "kvops-pytest-background"
CPU_CONTROLLERS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))  # cgroup v1's cpu hierarchy, v2's unified


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{CLOCK}: judges or measures on the wall clock; under `pytest -n 2` it runs "
                                       "on the clock worker, with the background tests at the lowest priority")
    idle = become_background_worker()
    workerinput = getattr(config, "workerinput", None)
    if idle is not None:
        config.stash[IDLE_GROUP] = idle
    elif workerinput is not None:
        config.stash[MACHINE_LOCK] = MachineLock(str(workerinput["testrunuid"]))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The background worker leaves its idle cgroup and removes it once empty (another run may still be in it)."""
    group = config.stash.get(IDLE_GROUP, None)
    if group is not None:
        with contextlib.suppress(OSError):
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()


class MachineLock:
    """Two flock(2) files shared by the workers of one run: the background workers hold `machine` shared for each
    test; the clock worker holds it exclusive over a stretch of ALONE_MARKERS tests. The clock worker also holds
    `turnstile` while it waits and runs, and the background passes through the turnstile before each test, so a
    background worker taking test after test cannot keep the clock worker waiting (flock prefers no one)."""

    def __init__(self, run_id: str) -> None:
        base = Path(tempfile.gettempdir()) / f"kvops-pytest-{run_id}"
        self.turnstile = os.open(f"{base}.turnstile", os.O_RDWR | os.O_CREAT, 0o600)
        self.machine = os.open(f"{base}.machine", os.O_RDWR | os.O_CREAT, 0o600)
        self.alone = False

    def take_alone(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.machine, fcntl.LOCK_EX)  # waits for the background's current test
        self.alone = True

    def give_back(self) -> None:
        fcntl.flock(self.machine, fcntl.LOCK_UN)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.alone = False

    def share(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        fcntl.flock(self.machine, fcntl.LOCK_SH)

    def unshare(self) -> None:
        fcntl.flock(self.machine, fcntl.LOCK_UN)


MACHINE_LOCK = pytest.StashKey[MachineLock]()
IDLE_GROUP = pytest.StashKey[Path]()  # the idle cgroup a background worker moved into


def runs_alone(item: pytest.Item | None) -> bool:
    return item is not None and any(item.get_closest_marker(name) is not None for name in ALONE_MARKERS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of one test under the run's MachineLock (only under xdist)."""
    lock = item.config.stash.get(MACHINE_LOCK, None)
    if lock is None:
        yield
        return
    if os.environ.get("PYTEST_XDIST_WORKER") != CLOCK_WORKER:
        lock.share()
        try:
            yield
        finally:
            lock.unshare()
        return
    if runs_alone(item) and not lock.alone:
        lock.take_alone()
    try:
        yield
    finally:
        if lock.alone and not runs_alone(nextitem):
            lock.give_back()


@pytest.hookimpl(tryfirst=True)  # before xdist's worker writes the groups into the node ids
def pytest_collection_modifyitems(items: Sequence[pytest.Item]) -> None:
    """The `clock` marker as an xdist group, so that the controller sees it in the node ids."""
    for item in items:
        if any(item.get_closest_marker(name) is not None for name in CLOCK_MARKERS):
            item.add_marker(pytest.mark.xdist_group(CLOCK))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist there is no controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The controller's scheduler: xdist's load-group scheduling, with the clock group sent to the clock worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ClockWorkerScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _assign_work_unit(self, node: Any) -> None:
            if CLOCK in self.workqueue:
                clock_node = next((n for n in self.nodes if n.gateway.id == CLOCK_WORKER), self.nodes[0])
                if node is clock_node:
                    self.workqueue.move_to_end(CLOCK, last=False)
                elif len(self.workqueue) > 1:
                    self.workqueue.move_to_end(CLOCK, last=True)
                else:
                    return  # only the clock group is left, and it is not this worker's
            super()._assign_work_unit(node)

    return ClockWorkerScheduling(config, log)


def idle_cgroup() -> Path | None:
    """Move this process (and what it starts from now on) into a cpu cgroup marked idle, where the kernel lets
    this process and root write it: its tasks then run only on what every other task leaves, and a task of any
    other group that wakes takes the CPU at once. The cgroup the process moved into, or None."""
    for root in CPU_CONTROLLERS:
        group = root / IDLE_CGROUP
        try:
            if root.name == "cgroup" and (root / "cgroup.subtree_control").exists():
                (root / "cgroup.subtree_control").write_text("+cpu")  # v2: the controller in the children
            group.mkdir(exist_ok=True)
            (group / "cpu.idle").write_text("1")
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            continue
        return group
    return None


def become_background_worker() -> Path | None:
    """In a background worker: the last CPU, nice 19 in a session (and autogroup) of its own, the idle scheduling
    policy, an idle cpu cgroup where it can have one, one torch thread, for this process and what it starts.
    Nothing in the clock worker or outside xdist. The idle cgroup the worker is in, or None."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or worker == CLOCK_WORKER:
        return None
    idle = idle_cgroup()
    with contextlib.suppress(OSError):  # a process-group leader cannot; then its group is pytest's, left at nice 0
        os.setsid()
        Path("/proc/self/autogroup").write_text(str(BACKGROUND_NICE))
    pinned = sorted(os.sched_getaffinity(0))[-1:]
    # Every thread of this process, not only the calling one: on Linux affinity and priority are per thread.
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, pinned)
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (PermissionError, ProcessLookupError):
            continue
    os.environ["OMP_NUM_THREADS"] = "1"  # torch started from here on, in this process or a child: one thread
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    return idle
