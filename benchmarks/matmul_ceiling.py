"""How close a decode step's matmuls are to what this machine can do: the read rate at few rows, multiply-adds at many.

`python benchmarks/matmul_ceiling.py` times, on SmolLM2-135M's projection and head shapes (fp32, 30 layers, random
weights, 539 MB):

- one pass over every weight at 1, 2, 4, 8 and 16 rows with the compiled matmul (kvops/engine/step_matmul.cpp's `gemv`),
  oneDNN and MKL (`F.linear`), median of 5 interleaved rounds;
- the two ceilings that bound such a pass: reading the weights (`w.sum()` over all of them, the fastest read
  torch does) and the compiled tile's own multiply-add rate with its operands in cache (weights of 96 x 256, 16
  rows: no memory traffic), on one thread and on all.

It prints each pass as ms, GB/s of weights read and GFLOP/s, against those ceilings. docs/benchmarks.md records a
run. Needs a C++ compiler (the compiled step is built or loaded from the cache as at engine start).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvops.engine.compiled import compile_step

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
ROWS = (1, 2, 4, 8, 16)
ROUNDS = 5

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(w, x, None, "none", [], "").t()


def _time(fn: Callable[[], object], repeat: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def read_rate(weights: list[torch.Tensor]) -> float:
    """GB/s of `w.sum()` over every weight: the read ceiling of a one-row pass."""
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    seconds = statistics.median(_time(lambda: [w.sum() for w in weights]) for _ in range(ROUNDS))
    return nbytes / seconds / 1e9


def tile_rate(gemv: Matmul, threads: int) -> float:
    """GFLOP/s of the compiled matmul on operands that stay in cache (its multiply-add ceiling)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x = torch.randn(96 * threads, 256), torch.randn(16, 256)
        for _ in range(200):
            gemv(x, w)
        seconds = statistics.median(_time(lambda: gemv(x, w), 2000) for _ in range(ROUNDS))
        return 2 * w.numel() * x.shape[0] / seconds / 1e9
    finally:
        torch.set_num_threads(previous)


def passes(weights: list[torch.Tensor], backends: dict[str, Matmul]) -> dict[str, list[float]]:
    """ms for one pass over every weight, per backend and row count: median of interleaved rounds."""
    generator = torch.Generator().manual_seed(0)
    inputs = {m: {k: torch.randn(m, k, generator=generator) for k in (576, 1536)} for m in ROWS}
    samples: dict[str, list[list[float]]] = {name: [[] for _ in ROWS] for name in backends}
    order = list(backends.items())
    for round_ in range(ROUNDS):
        for i, m in enumerate(ROWS):
            for name, fn in order if round_ % 2 == 0 else order[::-1]:
                seconds = _time(lambda fn=fn, m=m: [fn(inputs[m][w.shape[1]], w) for w in weights])
                samples[name][i].append(seconds * 1000)
    return {name: [statistics.median(s) for s in per_rows] for name, per_rows in samples.items()}


def main() -> None:
    ops = compile_step("on", torch.device("cpu"), "torch").ops
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(n, k, generator=generator) / 24 for n, k in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    threads = torch.get_num_threads()
    rate = read_rate(weights)
    peak = {1: tile_rate(ops.gemv, 1), threads: tile_rate(ops.gemv, threads)}
    print(f"{nbytes / 1e6:.0f} MB of weights, {threads} torch threads")
    print(f"read ceiling (w.sum()): {rate:.1f} GB/s, one pass at least {nbytes / rate / 1e6:.1f} ms")
    print(f"compiled tile in cache: {peak[1]:.1f} GFLOP/s on 1 thread, {peak[threads]:.1f} on {threads}")
    timings = passes(weights, {"compiled": ops.gemv, "onednn": _onednn, "mkl": F.linear})
    print(f"{'rows':>4} " + " ".join(f"{name:>26}" for name in timings))
    for i, m in enumerate(ROWS):
        cells = []
        for per_rows in timings.values():
            ms = per_rows[i]
            cells.append(f"{ms:7.1f} ms {nbytes / ms / 1e6:5.1f} GB/s {2 * params * m / ms / 1e6:5.1f} GF")
        print(f"{m:>4} " + " ".join(f"{c:>26}" for c in cells))
    best16 = min(per_rows[-1] for per_rows in timings.values())
    print(f"16 rows: the fastest pass runs at {2 * params * 16 / best16 / 1e6:.1f} GFLOP/s, "
          f"{2 * params * 16 / best16 / 1e6 / peak[threads]:.0%} of the in-cache tile on {threads} threads")


if __name__ == "__main__":
    main()
