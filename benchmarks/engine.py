"""The engine benchmark: `python benchmarks/engine.py [options]` is `kvops bench [options]`.

See `kvops/bench/engine.py` (or `kvops bench --help`) for the systems, workloads and options; the workloads
are in `kvops/bench/workloads.py`, the transformers systems in `kvops/bench/peers.py`.
"""

from __future__ import annotations

import sys

from kvops.bench.engine import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
