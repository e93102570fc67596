"""A client that hangs up mid-stream, as its own process.

A test's own process is a poor client for this: in CI it has been seen to stall for as long as vLLM generated
(all of its threads, the in-process supervisor's too), so its hang-up reached vLLM only after the stream had run to
max_tokens. A child process reads the first lines of the stream and exits; the kernel closes its socket then, however
busy the test's process is.
"""

from __future__ import annotations

import json
import subprocess
import sys

_CLIENT = """
import json, os, sys
import httpx
url, body, headers, lines = json.loads(sys.argv[1])
with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
    if response.status_code != 200:
        sys.exit(f"HTTP {response.status_code}: {response.read()[:500]!r}")
    read = 0
    for line in response.iter_lines():
        read += bool(line)
        if read >= lines:
            sys.stdout.write("hung up\\n")
            sys.stdout.flush()
            os._exit(0)  # no orderly close: the socket goes with the process
sys.exit(f"the stream ended after {read} lines, before the client could hang up")
"""


def hang_up(url: str, body: dict, headers: dict[str, str] | None = None, lines: int = 3,
            timeout_s: float = 120) -> None:
    """POST `body` to `url` as a stream from a child process that exits after `lines` non-empty lines."""
    done = subprocess.run([sys.executable, "-c", _CLIENT, json.dumps([url, body, headers or {}, lines])],
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0 and done.stdout.strip() == "hung up", \
        f"the hanging-up client exited {done.returncode}: {done.stdout}{done.stderr[-2000:]}"
