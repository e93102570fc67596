"""A start measured in a busy spell, and the engine's matmul choice measured again while serving.

`python benchmarks/linear_spell.py [--burners 2] [--seconds 100]` keeps `--burners` CPU-bound processes running
while the engine starts (its matmul backends are measured then: kvops/engine/linear.py), kills them once it is up, then
serves one stream (64 greedy tokens a request) for `--seconds`, printing tokens per second and the matmul split
after each request. The engine's log shows the start's measurement, the re-measurement a minute in, and any
change of backend. docs/engine.md records a run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from kvops.engine.config import EngineConfig
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=2, help="busy processes through the engine's start")
    parser.add_argument("--seconds", type=float, default=100.0, help="how long to serve after the start")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        time.sleep(1)
        llm = LLM(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024))
    finally:
        for burner in burners:
            burner.kill()
    model = llm.engine.model
    print(f"started in a busy spell: {model.linear_backend}", flush=True)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    started = time.time()
    while time.time() - started < args.seconds:
        began = time.time()
        [out] = llm.generate(["Tell me about the sea."], params)
        rate = len(out.token_ids) / (time.time() - began)
        print(f"{time.time() - started:5.0f} s  {rate:5.1f} tok/s  matmuls: {model.linear_backend}", flush=True)


if __name__ == "__main__":
    main()
