"""Scenario 1: a configuration that cannot hold one max_model_len request is refused at start,
with the numbers (needed, available, the largest max_model_len that fits)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from kvops.scenarios.runner import ScenarioResult

NAME = "capacity_refused"
TITLE = "A configuration that cannot fit max_model_len is refused at start"


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="KV bytes needed (before) vs available (after)",
                            command="kvops engine serve --kv-cache-memory 16MiB --max-model-len 8192")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvops", "engine", "serve", "--kv-cache-memory", "16MiB",
                           "--max-model-len", "8192", "--port", "0"], capture_output=True, text=True, timeout=300)
    result.diagnosed_at_s = result.detection_s = round(time.monotonic() - started, 2)
    result.signal_at_s = 0.0
    message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    result.evidence = {"exit_code": proc.returncode, "message": message}
    result.check("exits with code 2", proc.returncode == 2, f"exit code {proc.returncode}")
    numbers = re.search(r"needs (\d+) bytes .* gives (\d+) bytes .* largest max_model_len that fits is (\d+)", message)
    result.check("says needed, available and the largest max_model_len that fits", numbers is not None, message)
    result.check("no traceback", "Traceback" not in proc.stderr)
    if numbers:
        result.before, result.after = float(numbers.group(1)), float(numbers.group(2))
    result.passed = all(c.passed for c in result.checks)
    return result
