"""Every diagnosis reproduced on the real engine under the supervisor: fault → diagnosis → fix →
verification (kvops/scenarios, docs/scenarios.md). The quick ones run in every test run, and so does
`clean` (two minutes of healthy load: the false-positive check); the other long ones (a minute or more
each) are marked slow: `pytest -m slow tests/test_scenarios.py`."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import psutil
import pytest

from kvops.scenarios import scenarios
from kvops.scenarios.runner import ScenarioResult

# crash_loop goes last: the scenario run right after it has failed inside longer sessions and passed alone
# (prompt_variance in CI three times: its fix's after-window lost half its traffic; prefix_caching_off once here when
# it took that place). What crash_loop leaves behind is not found (docs/scenarios.md). prompt_variance runs with the
# slow ones until then (`pytest -m slow tests/test_scenarios.py`, or `kvops scenario run prompt_variance`).
QUICK = ("capacity_refused", "prefix_caching_off", "kv_quant_error", "oom_runtime", "clean", "crash_loop")
SLOW = ("tenant_pollution", "swap_storm", "prompt_variance")
# prompt_variance's rule waits for 15 s of traffic (a 30 s window), so that its automatic fix has a before-window
# with enough requests to be judged against.
DETECTION_S = {"prompt_variance": 20}
# On CPU the block size barely changes decode time, so this one passes or fails with the noise
# (docs/scenarios.md); it stays a command for machines where the effect is measurable.
COMMAND_ONLY = ("block_size",)


@pytest.fixture(autouse=True)
def _a_quiet_machine():
    """A scenario's timing judges a fix: nothing left over from earlier tests may compete for the CPUs.
    Child processes of this session still running (an engine, a server a test forgot) are named on stderr
    and stopped; the busiest other processes are named too, so a failure says what else was running."""
    me = psutil.Process()
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            print(f"scenario setup: stopping a leftover process {child.pid}: {' '.join(child.cmdline())[:200]}",
                  file=sys.stderr)
            child.kill()
    others = []
    for proc in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != me.pid:
                proc.cpu_percent(None)
                others.append(proc)
    time.sleep(0.5)
    busy = []
    for proc in others:
        with contextlib.suppress(psutil.Error):
            if (percent := proc.cpu_percent(None)) > 20:
                busy.append(f"{proc.pid} {proc.info['name']} {percent:.0f}%")
    if busy:
        print(f"scenario setup: busy beside the test: {', '.join(busy)}", file=sys.stderr)
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if threads:
        print(f"scenario setup: threads already running here: {', '.join(threads)}", file=sys.stderr)
    yield


def _run(name: str) -> ScenarioResult:
    result = scenarios()[name].run()
    failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
    assert result.passed, f"{name} failed: {failed or result.error}"
    assert result.checks, "a scenario that checks nothing proves nothing"
    return result


def test_every_diagnosis_has_a_scenario():
    assert set(scenarios()) == set(QUICK) | set(SLOW) | set(COMMAND_ONLY)


@pytest.mark.parametrize("name", QUICK)
def test_scenario(name: str):
    result = _run(name)
    if result.detection_s is not None:
        limit = DETECTION_S.get(name, 10)
        assert result.detection_s <= limit, f"detected {result.detection_s} s after the first signal"


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_slow_scenario(name: str):
    _run(name)
