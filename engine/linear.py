"""The matmul behind every projection.

On x86 CPUs PyTorch's default fp32 `F.linear` goes through MKL. Which of MKL and oneDNN is faster
depends on the processor and the row count: on an AMD EPYC (2 cores, weights streamed from DRAM)
oneDNN was 1.6–1.9× faster at 1–16 rows; on an Intel Xeon with AMX, MKL's matrix-vector path is
1.35–1.6× faster at 1–2 rows (one stream's decode step 69 → 43–47 ms) and oneDNN 1.2–1.4× faster
from 8 rows on (docs/benchmarks.md). So the engine measures both once at start, on model-shaped
weights larger than the caches, and sends the row counts where `F.linear` wins to it, the rest to
oneDNN (operands swapped, see `_onednn_linear`). `KVOPS_LINEAR=torch|onednn` forces one path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger("kvops.engine.linear")

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Computed as (W @ x^T)^T: the same values bit for bit, but oneDNN blocks the few-row decode
    # case much better this way round (16 rows × 3072 × 576: 407 µs against 570 µs).
    # The result is a transposed view; callers that need a contiguous layout ask for one.
    out = torch.ops.mkldnn._linear_pointwise(weight, x, None, "none", [], "").t()
    return out if bias is None else out + bias


# Row counts tried at start; F.linear takes a count when it is clearly (10%) faster there.
PROBE_ROWS = (1, 2, 4)
_CLEAR_WIN = 0.9


def select_linear(device: torch.device, dtype: torch.dtype,
                  weights: list[torch.Tensor] | None = None) -> tuple[str, Linear]:
    """The fastest linear that agrees with F.linear on this device, and its name. `weights`: the model's
    projections, timed with both backends (none given: oneDNN for every row count)."""
    choice = os.environ.get("KVOPS_LINEAR", "auto")
    if choice not in ("auto", "torch", "onednn"):
        raise ValueError(f"KVOPS_LINEAR={choice!r} is not one of auto, torch, onednn")
    if choice == "torch" or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "torch", _torch_linear
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, 64, generator=generator).to(dtype)
        w = torch.randn(32, 64, generator=generator).to(dtype)
        b = torch.randn(32, generator=generator).to(dtype)
        expected = F.linear(x, w, b)
        got = _onednn_linear(x, w, b)
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
            raise ValueError("oneDNN linear disagrees with F.linear")
    except Exception as exc:  # an older PyTorch without the op, or a build without oneDNN
        log.info("oneDNN linear unavailable; using F.linear", reason=str(exc)[:200])
        return "torch", _torch_linear
    if choice == "onednn" or not weights:
        return "onednn", _onednn_linear
    rows, timings = torch_rows(weights)
    log.info("linear backends measured", torch_up_to_rows=rows, ms_per_pass=timings)
    if rows == 0:
        return "onednn", _onednn_linear

    def split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _torch_linear(x, weight, bias) if x.shape[0] <= rows else _onednn_linear(x, weight, bias)

    return f"torch up to {rows} rows, onednn above", split


def torch_rows(weights: list[torch.Tensor]) -> tuple[int, dict[str, list[float]]]:
    """The largest of PROBE_ROWS up to which F.linear beats oneDNN clearly at every count (0: nowhere), and
    each backend's time for one pass over all `weights` per row count, in ms (the better of two, the
    backends interleaved so a slow spell of the machine hits both)."""
    generator = torch.Generator().manual_seed(0)
    timings: dict[str, list[float]] = {"torch": [], "onednn": []}
    widths = sorted({w.shape[1] for w in weights})
    for m in PROBE_ROWS:
        inputs = {k: torch.randn(m, k, generator=generator).to(weights[0].dtype) for k in widths}
        best: dict[str, float] = {}
        for name, fn in (("onednn", _onednn_linear), ("torch", _torch_linear)) * 2:
            started = time.perf_counter()
            for w in weights:
                fn(inputs[w.shape[1]], w, None)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
        for name in timings:
            timings[name].append(round(best[name] * 1000, 2))
    return torch_rows_from(timings), timings


def torch_rows_from(timings: dict[str, list[float]]) -> int:
    """The split from timings per PROBE_ROWS count: the largest count up to which F.linear is clearly faster at
    every count from one row up (0: not even at one row). One threshold, so a win at 4 rows after a loss at 2
    does not count."""
    rows = 0
    for m, torch_ms, onednn_ms in zip(PROBE_ROWS, timings["torch"], timings["onednn"], strict=True):
        if torch_ms >= _CLEAR_WIN * onednn_ms:
            break
        rows = m
    return rows
