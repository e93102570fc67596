"""`pytest -n 2` as the README runs it: the clock tests in order on gw0 at normal priority, the rest on the background
worker, pinned to one CPU at nice 19 (tests/helpers/clock_worker.py). A real inner session with two real workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.clock_worker import BACKGROUND_NICE

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import json, os, time, pytest

def record(name, start=None):
    # Empty in a process of the boot session (CI's container): that group is the root's, not an autogroup.
    path = "/proc/self/autogroup"
    group = (open(path).read().split() or [None])[-1] if os.path.exists(path) else None
    idle = None  # cpu.idle of this process's cpu cgroup, where it is not the root
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, where = line.split(":", 2)
        base = {"cpu": "/sys/fs/cgroup/cpu", "": "/sys/fs/cgroup"}.get(
            "cpu" if "cpu" in controllers.split(",") else controllers)
        if base and where != "/" and os.path.exists(f"{base}{where}/cpu.idle"):
            idle = open(f"{base}{where}/cpu.idle").read().strip()
    with open(os.environ["CLOCK_RECORD"], "a") as out:
        out.write(json.dumps({"test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                              "nice": os.getpriority(os.PRIO_PROCESS, 0), "group_nice": group,
                              "session_leader": os.getsid(0) == os.getpid(), "cgroup_idle": idle,
                              "start": start or time.time(), "end": time.time(),
                              "cpus": sorted(os.sched_getaffinity(0))}) + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_background(n):
    start = time.time()
    time.sleep(0.2)
    record(f"background-{n}", start)

@pytest.mark.clock
@pytest.mark.parametrize("n", range(4))
def test_clock(n):
    record(f"clock-{n}")

@pytest.mark.vllm
@pytest.mark.parametrize("n", range(2))
def test_alone(n):
    start = time.time()
    time.sleep(0.5)
    record(f"alone-{n}", start)

@pytest.mark.parametrize("n", range(6))
def test_background_after(n):
    start = time.time()
    time.sleep(0.2)
    record(f"after-{n}", start)
'''


@pytest.fixture
def record(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The inner session's test file, and the file its tests write where and how they ran to."""
    path = pytester.path / "record.jsonl"
    monkeypatch.setenv("CLOCK_RECORD", str(path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(test_inner=INNER)
    return path


@pytest.mark.clock  # two CPUs: the background worker it runs is pinned to one of them
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the background worker's pinning needs two CPUs")
def test_clock_tests_run_in_order_on_the_clock_worker_and_the_rest_in_the_background(
        pytester: pytest.Pytester, record: Path) -> None:
    done = pytester.runpytest_subprocess("-p", "tests.helpers.clock_worker", "-n", "2", "--dist", "loadgroup")
    done.assert_outcomes(passed=18)
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    clock = [r for r in runs if r["test"].startswith("clock")]
    assert [r["test"] for r in clock] == [f"clock-{n}" for n in range(4)]
    alone = [r for r in runs if r["test"].startswith("alone")]
    assert [r["worker"] for r in alone] == ["gw0", "gw0"]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert all(r["worker"] == "gw0" and r["nice"] == ours and not r["session_leader"] for r in clock), clock
    background = [r for r in runs if r["worker"] != "gw0"]
    last_cpu = max(os.sched_getaffinity(0))
    assert background and all(r["nice"] == BACKGROUND_NICE and r["cpus"] == [last_cpu] for r in background), runs
    # Its own session, so that its autogroup's nice level (where the kernel has autogroups) is its own to lower.
    assert all(r["session_leader"] and r["group_nice"] in (str(BACKGROUND_NICE), None) for r in background), runs
    if all(r["cgroup_idle"] == "1" for r in background):
        return  # an idle cgroup: the background runs beside the vLLM tests, on what they leave
    assert not any(r["cgroup_idle"] for r in background), f"the background is in a cgroup that is not idle: {runs}"
    # Without one the vLLM tests have the machine to themselves: no background test ran while one did.
    beside = [(a["test"], b["test"]) for a in alone for b in background
              if b["start"] < a["end"] and b["end"] > a["start"]]
    assert not beside, f"background tests ran beside a test marked vllm: {beside}"


def test_without_xdist_every_test_runs_in_the_one_process(pytester: pytest.Pytester, record: Path) -> None:
    done = pytester.runpytest_subprocess("-p", "tests.helpers.clock_worker", "-p", "no:xdist")
    done.assert_outcomes(passed=18)
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    assert {r["worker"] for r in runs} == {None} and {r["nice"] for r in runs} == {os.getpriority(os.PRIO_PROCESS, 0)}
