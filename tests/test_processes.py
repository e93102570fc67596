"""kvops.processes.start_in_own_session: a child in a session of its own that keeps its parent's priority,
which Linux's autogroup would otherwise reset to nice 0 for the whole new session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvops.processes import start_in_own_session

HAS_AUTOGROUP = Path("/proc/self/autogroup").exists()

# Run at a nice level, at least this process's own (lowering it needs privilege), and report the child's session
# and its autogroup's nice level.
NICED_PARENT = """
import os, subprocess, sys
from pathlib import Path
from kvops.processes import start_in_own_session
os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), int(sys.argv[1])))
child = start_in_own_session([sys.executable, "-c", "import time; time.sleep(30)"])
try:
    print(os.getsid(child.pid) == child.pid, os.getsid(child.pid) != os.getsid(0))
    print(Path(f"/proc/{child.pid}/autogroup").read_text().split()[-1])
finally:
    child.kill()
    child.wait()
"""


def niced_parent(nice: int) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", NICED_PARENT, str(nice)], capture_output=True, text=True,
                          timeout=30, check=True)
    session, group_nice = done.stdout.splitlines()
    return session, group_nice


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="this kernel schedules without autogroups (/proc/self/autogroup)")
def test_a_child_in_its_own_session_keeps_the_parents_nice_level():
    parent = max(7, os.getpriority(os.PRIO_PROCESS, 0))  # a niced test worker's child cannot go below its level
    session, group_nice = niced_parent(7)
    assert session == "True True", "the child leads a session of its own"
    assert group_nice == str(parent), f"the child's autogroup is at nice {group_nice}, its parent at {parent}"


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="this kernel schedules without autogroups (/proc/self/autogroup)")
def test_a_parent_at_nice_0_leaves_the_childs_new_group_at_its_default():
    own = os.getpriority(os.PRIO_PROCESS, 0)  # a niced test worker: its children inherit it
    _, group_nice = niced_parent(0)
    assert group_nice == str(own)


def test_the_child_gets_the_popen_arguments():
    child = start_in_own_session([sys.executable, "-c", "print('hello')"], stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=30)
    assert out.strip() == b"hello" and child.returncode == 0
