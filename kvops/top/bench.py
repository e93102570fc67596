"""How long the block map takes to lay out and render: `python -m kvops.top.bench`.

Not a test: timings on a shared CI machine are noise. The target is well under 50 ms for a
16k-block map into a 120x20 panel (a 1 s refresh must leave the terminal responsive).
"""

from __future__ import annotations

import random
import sys
import time

from rich.console import Console

from kvops.top.block_map import CODE_PRIORITY, layout, render_rows


def synthetic_codes(num_blocks: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    weights = {"s": 1, "p": 2, "f": 4, "F": 40, "c": 20, ".": 33}
    runs, total = [], 0
    while total < num_blocks:
        n = min(rng.randint(1, 64), num_blocks - total)
        runs.append(rng.choices(CODE_PRIORITY, weights=[weights[c] for c in CODE_PRIORITY])[0] * n)
        total += n
    return "".join(runs)


def bench(num_blocks: int = 16_384, width: int = 120, height: int = 20, repeat: int = 50) -> float:
    """Mean milliseconds for layout + Rich render + console rendering to segments."""
    codes = synthetic_codes(num_blocks)
    console = Console(width=width, file=open("/dev/null", "w"), color_system="standard")  # noqa: SIM115
    start = time.perf_counter()
    for _ in range(repeat):
        grid = layout(codes, width, height)
        text = render_rows(grid.rows)
        list(console.render(text))
    return (time.perf_counter() - start) / repeat * 1000


def main() -> int:
    for blocks in (1_024, 16_384, 131_072):
        for width, height in ((120, 20), (60, 8)):
            print(f"{blocks:>7} blocks into {width}x{height}: {bench(blocks, width, height):6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
