"""The matmul behind every projection.

On x86 CPUs PyTorch's default fp32 `F.linear` goes through MKL, which on AMD processors runs
well below oneDNN: measured here (AMD EPYC, 2 cores, weights streamed from DRAM) oneDNN's
linear is 1.6–1.9× faster at 1–16 rows, and more with the operands swapped (see
`_onednn_linear`). The engine uses oneDNN where PyTorch has it and the self-check agrees with
`F.linear`; `KVOPS_LINEAR=torch` forces the plain path.
"""

from __future__ import annotations

import os
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


def select_linear(device: torch.device, dtype: torch.dtype) -> tuple[str, Linear]:
    """The fastest linear that agrees with F.linear on this device, and its name."""
    choice = os.environ.get("KVOPS_LINEAR", "auto")
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
    return "onednn", _onednn_linear
